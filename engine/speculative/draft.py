"""Draft-model proposals: a small model with the target's tokenizer, beside the target on the
decode instance (on the driver rank, not sharded), with its own paged KV.

The draft has its own ModelRunner (so its own KVCache) and its own BlockPool, sized like the
target's plus one proposal's worth per sequence. Per request it remembers which tokens its KV
holds: `num_base` of the request's own tokens, then `tail`, the proposals it wrote after them.

One `propose` call drafts for every decode of the step at once:
  1. sync: the request's tokens are append-only, so the draft's KV is valid for num_base tokens
     plus the leading tail tokens the target accepted; the rest is rolled back (the blocks past
     the valid length go back to the draft pool),
  2. catch up and draft d1: one chunk per request, its tokens not seen yet (the whole prompt
     on a request's first step, also one that arrived with its target KV from a prefill),
  3. d2..dk: k - 1 batched one-token steps; the last proposal's KV is never written.
A request whose draft blocks do not fit in the draft pool proposes nothing this step (the
draft never preempts). `release` frees all of a request's draft blocks, once: the scheduler
calls it wherever the target's blocks go (finish, abort, preemption, hand-off, migration).

Greedy requests draft argmax tokens. Sampled ones draw d_j from q_j, the draft's filtered
probabilities under the request's temperature, top-k and top-p, with noise from its own
stream (salt 2) of mix_seed(seed, position), and keep q for rejection sampling (verify.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import parallel
from engine.batch import ScheduledBatch, SequenceChunk
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import filtered_probs, mix_seed
from engine.sampling_noise import uniforms

DRAFT_SALT = 2  # the noise stream of draft draws (1: verification's acceptance test)
FORWARD_WEIGHT = 0.2  # of the newest one-token draft forward in `forward_s`


@dataclass
class _DraftSeq:
    block_table: list[int] = field(default_factory=list)
    num_base: int = 0  # the request's first num_base tokens have KV here
    tail: list[int] = field(default_factory=list)  # proposals with KV after them


class DraftModel:
    """The draft runner and its pool; `propose` for a step's decodes, `release` per request."""

    def __init__(
        self, config: EngineConfig, draft_dir: str, target: ModelConfig, num_target_blocks: int
    ) -> None:
        draft = ModelConfig.from_model_dir(draft_dir)
        check_compatible(draft_dir, draft, config.model_dir, target)
        assert config.speculative is not None
        self.num_tokens = config.speculative.num_tokens
        target_len = config.max_model_len or target.max_position_embeddings
        self.max_model_len = min(target_len, draft.max_position_embeddings)
        per_seq = -(-self.num_tokens // config.block_size) + 1
        num_blocks = num_target_blocks + config.max_num_seqs * per_seq
        draft_config = dataclasses.replace(
            config,
            model_dir=draft_dir,
            tensor_parallel_size=1,
            num_kv_blocks=num_blocks,
            max_model_len=self.max_model_len,
            speculative=None,
            cuda_graphs=False,
            fixed_shape_decode=False,
        )
        with parallel.without_tp():
            self.runner = ModelRunner(draft_config, 0, 1)
        self.block_size = config.block_size
        self.pool = BlockPool(self.runner.num_kv_blocks, enable_caching=False)
        self.seqs: dict[str, _DraftSeq] = {}
        self.probs: dict[str, torch.Tensor] = {}  # [k, vocab] q of a sampled request's drafts
        self.forward_s: float | None = None  # seconds of one batched draft forward (average)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        self.probs.pop(request_id, None)
        if seq is not None and seq.block_table:
            self.pool.free_sequence_blocks(seq.block_table)

    @torch.no_grad()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] proposals for requests[i] (a decode: one token without KV)."""
        self.probs.clear()
        wanted = [self._room(r, k) for r, k in zip(requests, num_tokens, strict=True)]
        active = [i for i, k in enumerate(wanted) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        chunks = [self._first_chunk(requests[i]) for i in active]
        for step in range(max((wanted[i] for i in active), default=0)):
            tokens = self._draw(chunks, [requests[i] for i in active], step)
            next_active, next_chunks = [], []
            for i, chunk, token in zip(active, chunks, tokens, strict=True):
                drafts[i].append(token)
                if len(drafts[i]) < wanted[i]:
                    next_active.append(i)
                    next_chunks.append(
                        SequenceChunk(
                            chunk.request_id, [token], chunk.context_len, chunk.block_table
                        )
                    )
            active, chunks = next_active, next_chunks
        for request, draft in zip(requests, drafts, strict=True):
            seq = self.seqs.get(request.request_id)
            if seq is not None and draft:
                seq.num_base = request.num_tokens
                seq.tail = draft[:-1]  # the last proposal was never run through the draft
        return drafts

    def _room(self, request: Request, num_tokens: int) -> int:
        """Sync the request's draft KV (module doc, 1.) and reserve blocks for num_tokens
        proposals; the number it may propose (0 when the pool or the model length is short)."""
        num_tokens = min(num_tokens, self.max_model_len - request.num_tokens + 1)
        if num_tokens <= 0:
            return 0
        seq = self.seqs.setdefault(request.request_id, _DraftSeq())
        new = request.all_token_ids[seq.num_base : seq.num_base + len(seq.tail)]
        num_kept = 0
        while num_kept < len(new) and new[num_kept] == seq.tail[num_kept]:
            num_kept += 1
        # the last token always runs again: its logits give d1 (its KV is rewritten as it was)
        seq.num_base = min(seq.num_base + num_kept, request.num_tokens - 1)
        seq.tail = []
        # KV through the proposal before the last: positions [0, num_tokens + k - 1)
        num_needed = -(-(request.num_tokens + num_tokens - 1) // self.block_size)
        num_valid = -(-seq.num_base // self.block_size)
        if len(seq.block_table) > num_valid:  # blocks only rolled-back tokens reached
            self.pool.free_sequence_blocks(seq.block_table[num_valid:])
            del seq.block_table[num_valid:]
        extra = num_needed - len(seq.block_table)
        if extra > 0:
            if not self.pool.can_allocate(extra):
                return 0
            seq.block_table.extend(self.pool.allocate(extra))
        return num_tokens

    def _first_chunk(self, request: Request) -> SequenceChunk:
        seq = self.seqs[request.request_id]
        tokens = request.all_token_ids[seq.num_base :]
        return SequenceChunk(request.request_id, tokens, seq.num_base, seq.block_table)

    def _draw(self, chunks: list[SequenceChunk], requests: list[Request], step: int) -> list[int]:
        """One draft forward over `chunks`; each request's next proposal."""
        started = time.perf_counter()
        with parallel.without_tp():
            logits = self.runner.execute(ScheduledBatch(chunks))  # [len(chunks), vocab]
        tokens: list[int] = logits.argmax(dim=-1).tolist()  # the host sync: the forward's end
        seconds = time.perf_counter() - started
        if step > 0:  # one token per sequence, as the cost check prices it
            last = self.forward_s
            self.forward_s = seconds if last is None else last + FORWARD_WEIGHT * (seconds - last)
        for i, request in enumerate(requests):
            params = request.params
            if params.greedy:
                continue
            q = filtered_probs(logits[i : i + 1], [params])[0]
            seed = mix_seed(params.seed or 0, request.num_output_tokens + step)
            noise = uniforms([seed], q.shape[0], q.dtype, q.device, salt=DRAFT_SALT)[0]
            tokens[i] = int((q / noise.log_().neg_()).argmax())
            rows = self.probs.get(request.request_id)
            q = q.unsqueeze(0)
            self.probs[request.request_id] = q if rows is None else torch.cat([rows, q])
        return tokens


def check_compatible(
    draft_dir: str, draft: ModelConfig, target_dir: str, target: ModelConfig
) -> None:
    """Refuse a draft whose token ids mean other things than the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model must use the target's tokenizer"
        )
    vocabs = [_tokenizer_vocab(Path(d)) for d in (draft_dir, target_dir)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        raise ValueError(
            f"draft model {draft_dir} has another tokenizer than the target {target_dir} "
            "(tokenizer.json vocabularies differ): a draft model must use the target's tokenizer"
        )


def _tokenizer_vocab(model_dir: Path) -> object | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    return model.get("vocab")
