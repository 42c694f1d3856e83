"""A minimal greedy continuous-batching loop over an Executor, for parity tests.

Not the engine's scheduler (that is engine/scheduler.py): just enough to drive the executor the
way the scheduler does. Each step, every unfinished sequence contributes either its next prompt
chunk (the whole prompt, or `chunk_size` tokens at a time) or a 1-token decode chunk, so with
chunking prefill chunks and decode chunks share steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.block_pool import BlockPool
from engine.executor import Executor


@dataclass
class GreedyResult:
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] row per sampled token


def greedy_generate(
    executor: Executor,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk_size: int | None = None,
) -> list[GreedyResult]:
    pool = BlockPool(executor.num_kv_blocks, enable_caching=False)
    block_size = executor.block_size
    tables = [pool.allocate(-(-(len(p) + max_new_tokens) // block_size)) for p in prompts]
    results = [GreedyResult() for _ in prompts]
    num_computed = [0] * len(prompts)
    while any(len(r.token_ids) < max_new_tokens for r in results):
        chunks: list[SequenceChunk] = []
        for i, prompt in enumerate(prompts):
            if len(results[i].token_ids) == max_new_tokens:
                continue
            all_ids = prompt + results[i].token_ids
            if num_computed[i] < len(prompt):
                end = (
                    len(prompt)
                    if chunk_size is None
                    else min(len(prompt), num_computed[i] + chunk_size)
                )
            else:
                end = len(all_ids)
            chunks.append(
                SequenceChunk(
                    request_id=str(i),
                    token_ids=all_ids[num_computed[i] : end],
                    start_pos=num_computed[i],
                    block_table=tables[i],
                    sample=end == len(all_ids),
                )
            )
            num_computed[i] = end
        logits = executor.execute(ScheduledBatch(chunks))
        assert logits.shape == (sum(c.sample for c in chunks), executor.model_config.vocab_size)
        sampled = [int(c.request_id) for c in chunks if c.sample]
        for row, i in enumerate(sampled):
            results[i].logits.append(logits[row])
            results[i].token_ids.append(int(logits[row].argmax()))
    for table in tables:
        pool.free_sequence_blocks(table)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    return results
