"""A stand-in for the model that checks the scheduler's block tables: a paged store of token ids.

Each chunk writes its tokens into the slots its block table names, then reads the whole context
back through the block table and asserts it equals the request's tokens, so a wrong block id, a
block reused while still needed, or a prefix-cache hit on other tokens fails at once. The
"logits" are a hash of the context read back, so outputs depend on what the blocks hold.
"""

from __future__ import annotations

from engine.batch import ScheduledBatch
from engine.block_pool import BlockPool
from engine.outputs import StepOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

VOCAB_SIZE = 97
EOS = 0


def next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token is a hash of the context (never EOS)."""
    value = len(context)
    for token in context[-6:]:
        value = (value * 1_000_003 + token) % 2_147_483_647
    return 1 + value % (VOCAB_SIZE - 1)


class PagedTokenStore:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_computed_tokens = 0  # tokens the 'model' actually computed (not cache hits)

    def execute(self, batch: ScheduledBatch, requests: dict[str, Request]) -> list[int]:
        sampled = []
        bs = self.block_size
        for chunk in batch.chunks:
            expected = requests[chunk.request_id].all_token_ids
            assert chunk.token_ids == expected[chunk.start_pos : chunk.context_len]
            assert len(chunk.block_table) * bs >= chunk.context_len
            assert len(set(chunk.block_table)) == len(chunk.block_table)
            for pos, token in enumerate(chunk.token_ids, chunk.start_pos):
                self.slots[chunk.block_table[pos // bs]][pos % bs] = token
            context = [
                self.slots[chunk.block_table[pos // bs]][pos % bs]
                for pos in range(chunk.context_len)
            ]
            assert context == expected[: chunk.context_len], "KV read back is not the sequence"
            self.num_computed_tokens += chunk.num_new_tokens
            if chunk.sample:
                sampled.append(next_token(context))  # type: ignore[arg-type]
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunk_size: int = 64,
    max_model_len: int = 1024,
    enable_caching: bool = True,
) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=enable_caching)
    return Scheduler(
        pool,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunk_size=chunk_size,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
    )


class Driver:
    """Runs a scheduler against a PagedTokenStore; records every batch and output."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.store = PagedTokenStore(scheduler.block_pool.num_blocks, scheduler.block_size)
        self.requests: dict[str, Request] = {}
        self.batches: list[ScheduledBatch] = []
        self.outputs: list[StepOutput] = []

    def add(self, request_id: str, prompt: list[int], **params: object) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        sampled = self.store.execute(batch, self.scheduler.requests)
        outputs = self.scheduler.update(batch, sampled)
        self.outputs += outputs
        return outputs

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished(), "did not finish: the scheduler is stuck"
        return {rid: list(r.output_token_ids) for rid, r in self.requests.items()}
