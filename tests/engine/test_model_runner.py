"""The runner's per-step inputs: decode chunks first, exact positions/slots, batch-order sampling."""

from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=tiny_model("llama"), block_size=8, num_kv_blocks=16))


def test_step_inputs_order_positions_and_slots(runner: ModelRunner) -> None:
    batch = ScheduledBatch(
        [
            SequenceChunk("a", [10, 11, 12, 13, 14], start_pos=0, block_table=[3]),
            SequenceChunk("b", [20], start_pos=9, block_table=[7, 2]),
            SequenceChunk("c", [30, 31, 32, 33], start_pos=8, block_table=[4, 5], sample=False),
            SequenceChunk("d", [40], start_pos=0, block_table=[6]),
        ]
    )
    inputs = runner.prepare_inputs(batch)
    # decode chunks (b, d) first, then prefill chunks (a, c) in batch order
    assert inputs.input_ids.tolist() == [20, 40, 10, 11, 12, 13, 14, 30, 31, 32, 33]
    assert inputs.positions.tolist() == [9, 0, 0, 1, 2, 3, 4, 8, 9, 10, 11]
    # slot = block_table[pos // 8] * 8 + pos % 8
    assert inputs.metadata.slot_mapping.tolist() == [17, 48, 24, 25, 26, 27, 28, 40, 41, 42, 43]
    assert inputs.metadata.num_decode_tokens == 2
    assert inputs.metadata.decode_context_lens.tolist() == [10, 1]
    assert inputs.metadata.decode_block_tables.tolist() == [[7, 2], [6, 0]]
    assert [(p.token_start, p.start_pos, p.context_len) for p in inputs.metadata.prefills] == [
        (2, 0, 5),
        (7, 8, 12),
    ]
    # sampled chunks a, b, d in batch order -> their last tokens' rows
    assert inputs.sample_indices.tolist() == [6, 0, 1]
    logits = runner.execute(batch)
    assert logits.shape == (3, runner.model_config.vocab_size)
    assert logits.dtype == torch.float32


def test_bad_chunks_are_rejected(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        runner.execute(ScheduledBatch([SequenceChunk("x", list(range(9)), 0, [1])]))
    with pytest.raises(ValueError, match="exceed max_model_len"):
        runner.execute(ScheduledBatch([SequenceChunk("y", [1], 512, list(range(16)))]))
    assert runner.execute(ScheduledBatch([])).shape == (0, runner.model_config.vocab_size)
