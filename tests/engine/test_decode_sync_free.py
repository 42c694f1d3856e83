"""The fixed-shape decode step (the forward a CUDA graph captures, engine/graphs.py) never waits
for the host and never sizes a tensor by its data, for every family, dense and MoE.

Each family's tiny model runs in its GPU configuration (the Triton attention back end, the fused
ops where the family takes them; the kernels in Triton's interpreter) under a TorchDispatchMode
that records every aten op. The step fails on any op that synchronizes with the host on CUDA,
and two steps of one bucket over different data must run the same ops at the same shapes.

It also counts the kernels a step launches per decoder layer (a Triton kernel as one, view and
allocation ops as none) and prints the table that docs/gpu.md carries (`pytest -s`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from engine import parallel
from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from tests.tiny_models import FAMILIES, make_tiny_model

triton_interpreter = pytest.importorskip("triton.runtime.interpreter")

# Ops that wait for the GPU on CUDA: a scalar read, or an output sized by the data.
HOST_SYNC_OPS = {
    "aten._local_scalar_dense",  # .item(), .tolist(), int(t), bool(t)
    "aten.is_nonzero",
    "aten.equal",
    "aten.allclose",
    "aten.nonzero",
    "aten.argwhere",
    "aten.bincount",
    "aten.masked_select",
    "aten.unique_dim",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.histc",
    "aten._assert_async",
}
# Ops that launch no kernel: views, metadata and uninitialised allocations.
NO_LAUNCH_OPS = {
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten.slice",
    "aten.select",
    "aten.t",
    "aten.transpose",
    "aten.permute",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.expand",
    "aten.split",
    "aten.chunk",
    "aten.unbind",
    "aten.narrow",
    "aten.as_strided",
    "aten.alias",
    "aten.detach",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
}


def host_syncs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why `func(*args, **kwargs)` would wait for the host on CUDA, or None."""
    name = func.overloadpacket._qualified_op_name.replace("::", ".")
    if name in HOST_SYNC_OPS:
        return name
    if name == "aten.repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        if kwargs.get("output_size") is None:
            return "repeat_interleave with tensor repeats and no output_size"
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    for nested in (*args, *kwargs.values()):
        if isinstance(nested, list | tuple):
            tensors += [t for t in nested if isinstance(t, torch.Tensor)]
    if name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
        t.dtype == torch.bool for t in tensors[1:]
    ):
        return f"{name} with a boolean mask"
    if name in ("aten._to_copy", "aten.copy_") and "device" in kwargs:
        return f"{name} to another device"
    return None


class OpRecorder(TorchDispatchMode):
    """Records (op, output shapes) of every aten op, and each host-synchronizing op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (reason := host_syncs(func, args, kwargs)) is not None:
            self.syncs.append(reason)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, list | tuple) else [out]
        shapes = tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((func.overloadpacket._qualified_op_name.replace("::", "."), shapes))
        return out

    def record_launch(self, kernel: str) -> None:
        self.ops.append((f"triton.{kernel}", ()))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpRecorder]:
    """A recorder in which each Triton kernel launch is one op (its interpreter run unrecorded)."""
    recorder = OpRecorder()
    interpreted = triton_interpreter.InterpretedFunction
    run = interpreted.run

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.record_launch(self.fn.__name__)
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreted, "run", launch)
    yield recorder


def _layers(family: str, num_layers: int) -> dict[str, Any]:
    """Overrides for a `num_layers`-layer model whose layers are all alike."""
    overrides: dict[str, Any] = {"num_hidden_layers": num_layers}
    if family == "qwen3_moe":
        overrides["mlp_only_layers"] = []  # every layer sparse
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention"] * num_layers
    return overrides


def _runner(model_dir: str) -> ModelRunner:
    parallel.set_tp_group(None, 0, 1)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",  # the interpreter's dtype; on CUDA bf16 runs the same ops
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=64,
        fixed_shape_decode=True,
        attention_backend="triton",
        fused_ops=True,  # taken where the family supports it, as on CUDA
    )
    return ModelRunner(config)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [30]]
TABLES = [[3, 9], [7], [20, 2, 30], [5]]


def _decode_step(runner: ModelRunner, recorder: OpRecorder, num_seqs: int, step: int) -> None:
    """Record the captured forward of one pure-decode step of `num_seqs` sequences (bucket 4)."""
    graphs = runner.decode_graphs
    assert graphs is not None
    chunks = [
        SequenceChunk(str(i), [40 + i + step], len(PROMPTS[i]) + step, TABLES[i])
        for i in range(num_seqs)
    ]
    assert graphs.fits(chunks) and graphs.bucket(num_seqs) == 4
    graphs._stage(chunks, 4)  # the host-side staging before a replay
    with torch.no_grad(), recorder:
        graphs._forward(4, 4 - num_seqs)  # what capture() records into the graph


def _trace(model_dir: str, recorder: OpRecorder, num_seqs: int, step: int) -> list[Any]:
    runner = _runner(model_dir)
    prefill = [
        SequenceChunk(str(i), p, 0, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))
    ]
    runner.execute(ScheduledBatch(prefill))
    recorder.ops.clear()
    _decode_step(runner, recorder, num_seqs, step)
    return list(recorder.ops)


def launches(ops: list[tuple[str, Any]]) -> int:
    return sum(op not in NO_LAUNCH_OPS for op, _ in ops)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_step_never_waits_for_the_host(
    family: str, tmp_path: Path, recorder: OpRecorder
) -> None:
    model_dir = make_tiny_model(tmp_path, family, **_layers(family, 2))
    full = _trace(model_dir, recorder, num_seqs=4, step=0)
    assert recorder.syncs == [], f"{family}: host syncs in the captured decode step"
    # Other tokens, positions and one padding row: the same ops at the same shapes.
    assert _trace(model_dir, recorder, num_seqs=3, step=1) == full
    assert recorder.syncs == []
    one_layer = make_tiny_model(tmp_path / "one", family, **_layers(family, 1))
    per_layer = launches(full) - launches(_trace(one_layer, recorder, num_seqs=4, step=0))
    assert per_layer > 0
    print(f"\n{family}: {launches(full)} launches per 2-layer step, {per_layer} per layer")


@pytest.mark.parametrize(
    "step",
    [
        lambda x: x.sum().item(),
        lambda x: torch.bincount(x.long().abs(), minlength=4),
        lambda x: x[x > 0],
        lambda x: torch.nonzero(x),
        lambda x: torch.repeat_interleave(x, x.long().abs()),
        lambda x: torch.unique(x),
        lambda x: bool(x.any()),
    ],
)
def test_the_recorder_catches_each_host_sync(step: Callable[[torch.Tensor], Any]) -> None:
    recorder = OpRecorder()
    with recorder:
        step(torch.tensor([1.0, -2.0, 0.0, 3.0]))
    assert recorder.syncs, recorder.ops


def test_the_shape_check_sees_a_tensor_sized_by_the_data() -> None:
    traces = []
    for size in (2, 3):
        recorder = OpRecorder()
        with recorder:
            torch.zeros(size)
        traces.append(recorder.ops)
    assert traces[0] != traces[1]
