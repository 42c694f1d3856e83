"""The fixed-shape decode path (engine/graphs.py), run eagerly on CPU: buckets, the buffers a
step fills (padding rows included), which steps take it, and logits equal to the eager path's.

Token parity with transformers on this path is in test_model_parity.py and test_families.py
(their `fixed-shape` cases). CUDA graph capture and replay are in test_cuda_graphs.py (GPU).
"""

from __future__ import annotations

import pytest
import torch

from engine import parallel
from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.graphs import batch_buckets
from engine.model_runner import ModelRunner


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(4096)[-2:] == [496, 512]


def _runner(model_dir: str, fixed_shape: bool) -> ModelRunner:
    parallel.set_tp_group(None, 0, 1)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_model_len=64,
        fixed_shape_decode=fixed_shape,
    )
    return ModelRunner(config)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]
TABLES = [[3, 9], [7], [20, 2, 30]]


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill of three prompts, then two pure-decode steps of the three (bucket 4)."""
    chunks = [
        SequenceChunk(str(i), p, 0, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))
    ]
    logits = [runner.execute(ScheduledBatch(chunks))]
    for step in range(2):
        decodes = [
            SequenceChunk(str(i), [40 + i], len(p) + step, t)
            for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))
        ]
        logits.append(runner.execute(ScheduledBatch(decodes)))
    return logits


def test_padded_buffers_and_logits_equal_the_eager_path(tiny_model) -> None:
    model_dir = tiny_model("llama")
    eager = _steps(_runner(model_dir, fixed_shape=False))
    runner = _runner(model_dir, fixed_shape=True)
    assert runner.decode_graphs is not None and not runner.decode_graphs.graphs
    fixed = _steps(runner)
    for ours, theirs in zip(fixed, eager, strict=True):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 1e-12
    graphs = runner.decode_graphs
    # the last step: positions 6, 3, 10 of tables [3, 9], [7], [20, 2, 30]; one padding row
    assert graphs.input_ids[:4].tolist() == [40, 41, 42, 0]
    assert graphs.positions[:4].tolist() == [6, 3, 10, 0]
    assert graphs.slot_mapping[:4].tolist() == [9 * 4 + 2, 7 * 4 + 3, 30 * 4 + 2, -1]
    assert graphs.context_lens[:4].tolist() == [7, 4, 11, 0]
    assert graphs.block_tables[:3, :3].tolist() == [[3, 9, 0], [7, 0, 0], [20, 2, 30]]


def test_which_steps_take_the_fixed_shape_path(tiny_model) -> None:
    graphs = _runner(tiny_model("llama"), fixed_shape=True).decode_graphs
    assert graphs is not None
    decode = SequenceChunk("a", [1], 4, [0, 1])
    assert graphs.fits([decode] * 8)
    assert not graphs.fits([decode] * 9)  # above the largest bucket: eager
    assert not graphs.fits([decode, SequenceChunk("b", [1, 2], 0, [2])])  # mixed: eager
    assert not graphs.fits([SequenceChunk("c", [1, 2], 4, [0, 1], num_draft=1)])  # speculative
    assert not graphs.fits([SequenceChunk("d", [1], 3, [0], sample=False)])
    assert not graphs.fits([])
    assert not graphs.fits([SequenceChunk("e", [1], 4, list(range(graphs.max_blocks + 1)))])


def test_off_by_default_on_cpu(tiny_model) -> None:
    assert _runner(tiny_model("llama"), fixed_shape=None).decode_graphs is None  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["cuda-graphs", ""])
def test_unknown_attention_backend_is_rejected(tiny_model, bad: str) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir=tiny_model("llama"), attention_backend=bad)


def test_the_triton_back_end_outside_cuda_needs_the_interpreter(monkeypatch) -> None:
    from engine.attention import select_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        select_backend("cpu", 16, "triton")
    assert select_backend("cpu", 16).name == "torch"  # auto never picks it on CPU
