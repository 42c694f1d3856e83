"""Every Triton kernel of engine/kernels/ compiled for real GPUs (sm_90, sm_80) on a CPU machine.

The engine's own wrappers run on CPU tensors at real model shapes, in the order of one fused
Llama layer (engine/models/fused_llama.py) with the Triton attention back end, in eager and
fixed-shape decode steps. Each kernel is replaced by a recorder: a launch is bound by
`JITFunction.run` itself (Triton's binder and specialization: pointer dtypes, divisibility by
16, an int equal to 1 as a constexpr), with a stand-in driver that names the target and
`knobs.runtime.jit_cache_hook` taking the specialization instead of compiling. Child processes
compile each distinct specialization with `JITFunction.preload` and the ptxas that ships with
Triton; no GPU or CUDA driver is needed. They run without TRITON_INTERPRET, which
tests/conftest.py sets: under it triton.language's own jit functions (tl.sum, tl.max) are
interpreter functions, which the compiler cannot lower.

A compile fails the test on an error, on spilled registers (bfloat16, float16 or float32), or on
shared memory above what one block may use on the target. Registers and spills (local memory in 32-bit
words, as Triton's `n_spills`) come from the cubin's resource usage (cuobjdump): `n_regs` and
`n_spills` themselves need a driver. Shared memory is the kernel's `metadata.shared`.
`pytest -s` prints the table; `!16:` names the arguments that missed divisibility by 16.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import torch

triton = pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction, KernelInterface  # noqa: E402

import engine.kernels  # noqa: E402
from engine.attention import build_attention_metadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.graphs import DecodeGraphs  # noqa: E402
from engine.kernels.fused_ops import add_rms_norm, rotary_, silu_and_mul  # noqa: E402
from engine.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from engine.rope import RotaryEmbedding  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (90, 80)
# Shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100, H100.
SHARED_LIMIT = {80: 166_912, 90: 232_448}
SPILL_CHECKED = ("bf16", "fp16", "fp32")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_SIZES = sorted({EngineConfig.block_size, 16, 32})


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    sliding_window: int | None = None


SHAPES = (
    Shape("tinyllama-1.1b", 2048, 32, 4, 64, 5632, 2048),  # benchmarks/engine_speed.py "1b"
    Shape("smollm2-135m", 576, 9, 3, 64, 1536, 8192),  # the demo model; GQA 3
    Shape("llama-2-7b", 4096, 32, 32, 128, 11008, 4096),  # GQA 1: group_size is a constexpr
    Shape("mistral-7b", 4096, 32, 8, 128, 14336, 32768, sliding_window=4096),  # GQA 4
    Shape("phi-3-mini", 3072, 32, 32, 96, 8192, 4096, sliding_window=2047),  # window % 16 != 0
)


@dataclass
class Compile:
    """One distinct specialization for one target, and what compiling it gave."""

    kernel: str
    arch: int
    dtype: str  # the element type of the kernel's first pointer
    spec: str  # constexprs (ints equal to 1 included) and the arguments not divisible by 16
    data: str = field(repr=False)  # Triton's specialization data, preload's input
    cases: list[str] = field(default_factory=list)
    regs: int = 0
    spills: int = 0
    shared: int = 0
    error: str | None = None


def violations(row: Compile) -> list[str]:
    """Why this compile would fail or run badly on its target; empty when it is fine."""
    if row.error is not None:
        return [f"compile error: {row.error}"]
    found = []
    if row.spills and row.dtype in SPILL_CHECKED:
        found.append(f"{row.spills} spilled registers")
    if row.shared > SHARED_LIMIT[row.arch]:
        found.append(f"{row.shared} B shared memory > {SHARED_LIMIT[row.arch]} B on sm_{row.arch}")
    return found


def table(rows: list[Compile]) -> str:
    lines = [f"{'kernel':21} sm dtype regs spill   smem  spec / cases"]
    for r in sorted(rows, key=lambda r: (r.kernel, r.dtype, r.spec, -r.arch)):
        figures = f"{r.regs:4} {r.spills:5} {r.shared:6}" if r.error is None else f"{'ERROR':16}"
        more = f" (+{len(r.cases) - 1})" if len(r.cases) > 1 else ""
        lines.append(f"{r.kernel:21} {r.arch} {r.dtype:5} {figures}  {r.spec} / {r.cases[0]}{more}")
    return "\n".join(lines)


class _TargetDriver:
    """Stands in for the CUDA driver: a warmup-only JITFunction.run, and preload, ask it for a
    device, a stream and the target, and nothing else."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def _fresh_jit(kernel: Any) -> JITFunction:
    """A JITFunction of the kernel's function with caches of its own (one per target). Under the
    interpreter `@triton.jit` gave an InterpretedFunction, which keeps the decorator's kwargs."""
    if not isinstance(kernel, JITFunction):
        return JITFunction(kernel.fn, **kernel.kwargs)
    names = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")
    return JITFunction(kernel.fn, **{name: getattr(kernel, name) for name in names})


def _project_kernels() -> dict[str, Any]:
    """Every @triton.jit function defined in engine/kernels/, by module attribute path."""
    kernels = {}
    for info in pkgutil.iter_modules(engine.kernels.__path__):
        module = importlib.import_module(f"engine.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__:
                kernels[f"{module.__name__}.{name}"] = value
    return kernels


KERNELS = _project_kernels()


def _row(path: str, arch: int, data: str) -> Compile:
    obj = json.loads(data)
    names, types = list(obj["signature"]), list(obj["signature"].values())
    spec = [
        f"{names[key[0]]}={int(v) if isinstance(v, bool) else v}"
        for key, v in zip(obj["constant_keys"], obj["constant_vals"], strict=True)
    ]
    odd = [  # floats and bools have no attrs entry; constexprs have an empty one
        names[key[0]]
        for key, attrs in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True)
        if not attrs and types[key[0]] != "constexpr"
    ]
    spec += [f"!16:{','.join(odd)}"] if odd else []
    pointers = [t[1:] for t in types if t.startswith("*")]
    return Compile(path.rpartition(".")[2], arch, pointers[0], " ".join(spec), data)


class _Binder:
    """Replaces every project kernel with a recorder that binds each launch for each target."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.compiles: dict[str, Compile] = {}  # by specialization data: identical ones once
        self.case = ""
        self._driver = _TargetDriver(GPUTarget("cuda", ARCHS[0], 32))
        self._jit: dict[tuple[str, int], JITFunction] = {}
        self._captured: list[str] = []
        mp.setattr(driver, "_active", self._driver)
        mp.setattr(knobs.runtime, "jit_cache_hook", self._hook)
        # a new JITFunction registers itself by name: keep the real kernels' entries afterwards
        registry = triton.runtime.jit._triton_jit_function_registry
        mp.setattr(triton.runtime.jit, "_triton_jit_function_registry", dict(registry))
        for path, kernel in KERNELS.items():
            module, _, name = path.rpartition(".")
            mp.setattr(sys.modules[module], name, self._recorder(path, kernel))

    def _hook(self, **kwargs: Any) -> bool:
        self._captured.append(kwargs["compile"]["specialization_data"])
        return True  # taken: JITFunction.run returns without compiling or launching

    def _recorder(self, path: str, kernel: Any) -> Any:
        binder = self

        class Recorder:  # `kernel[grid](*args, **kwargs)`
            def __getitem__(self, grid: Any) -> Any:
                return lambda *args, **kwargs: binder.bind(path, kernel, grid, args, kwargs)

        return Recorder()

    def bind(self, path: str, kernel: Any, grid: Any, args: Any, kwargs: dict[str, Any]) -> None:
        for arch in ARCHS:
            self._driver.target = GPUTarget("cuda", arch, 32)
            if (path, arch) not in self._jit:
                self._jit[path, arch] = _fresh_jit(kernel)
            self._jit[path, arch].run(*args, grid=grid, warmup=True, **kwargs)
            data = self._captured.pop()
            if data not in self.compiles:
                self.compiles[data] = _row(path, arch, data)
            self.compiles[data].cases.append(self.case)


def _decode_layer(shape: Shape, dtype: torch.dtype, block_size: int, graph_step: bool) -> None:
    """One decode step of one layer, launching the kernels as engine/models/fused_llama.py does."""
    num_seqs, heads, kv_heads, head_dim = 3, shape.num_heads, shape.num_kv_heads, shape.head_dim
    cache = KVCache(KVCacheSpec(1, 64, block_size, kv_heads, head_dim, dtype))
    backend = TritonAttentionBackend()
    if graph_step:  # the persistent buffers: tables as wide as max_model_len needs
        cpu = torch.device("cpu")
        max_num_seqs = EngineConfig.max_num_seqs
        graphs = DecodeGraphs(
            torch.nn.Identity(), backend, block_size, max_num_seqs, shape.max_positions, cpu
        )
        bucket = graphs.bucket(num_seqs)
        metadata = graphs._metadata(bucket, bucket - num_seqs)
        positions = graphs.positions[:bucket]
    else:  # tables as wide as the longest context: 6 blocks
        context_lens = [1, 37, 5 * block_size + 3]
        tables = [list(range(-(-n // block_size))) for n in context_lens]
        starts = [n - 1 for n in context_lens]
        metadata, positions = build_attention_metadata(
            starts, [1] * num_seqs, tables, num_seqs, block_size, torch.device("cpu")
        )
    num_tokens = positions.shape[0]
    rope = RotaryEmbedding(head_dim, shape.max_positions, {"rope_theta": 10000.0}, dtype)
    weight = torch.empty(shape.hidden_size, dtype=dtype)
    hidden = torch.empty(num_tokens, shape.hidden_size, dtype=dtype)
    _, residual = add_rms_norm(hidden, None, weight, 1e-5)
    qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    rotary_(qkv, positions, rope.cos, rope.sin, heads + kv_heads, head_dim)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    backend.forward(
        q, k, v, cache.key(0), cache.value(0), metadata, head_dim**-0.5, shape.sliding_window
    )
    add_rms_norm(torch.empty_like(hidden), residual, weight, 1e-5)
    silu_and_mul(torch.empty(num_tokens, 2 * shape.intermediate_size, dtype=dtype))


def _forced(rows: list[Compile]) -> tuple[Compile, Compile]:
    """The bfloat16 paged decode for sm_80 at head_dim 128 held to 64 registers (it must spill),
    and with 3 warps (not a power of two: it must fail)."""
    candidates = [r for r in rows if r.kernel == "_paged_decode_kernel" and r.arch == 80]
    base = next(r for r in candidates if r.dtype == "bf16" and "HEAD_DIM=128" in r.spec)
    forced = []
    for option, value in (("maxnreg", 64), ("num_warps", 3)):
        obj = json.loads(base.data)
        obj["options"][option] = value
        spec = f"{base.spec} {option}={value}"
        forced.append(Compile(base.kernel, 80, "bf16", spec, json.dumps(obj), [f"forced {option}"]))
    return forced[0], forced[1]


def _compile_all(rows: list[Compile], cache_dir: Path) -> None:
    """Compile the rows in child processes, one per core (at most 8); fill in their figures."""
    affinity = getattr(os, "sched_getaffinity", None)
    num_workers = max(1, min(8, len(affinity(0)) if affinity else os.cpu_count() or 1))
    # the slow ones first, dealt round robin: float32 attention takes several times the others
    order = sorted(rows, key=lambda r: (r.dtype != "fp32", r.kernel != "_paged_decode_kernel"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for w in range(num_workers):
            jobs, results, log = (Path(tmp, f"{name}{w}") for name in ("jobs", "results", "log"))
            share = order[w::num_workers]
            jobs.write_text(json.dumps([r.data for r in share]))
            command = [sys.executable, "-m", __name__, str(jobs), str(results)]
            with log.open("w") as out:  # a file, not a pipe: ptxas errors print whole PTX files
                child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
            children.append((child, share, results, log))
        for child, share, results, log in children:
            code = child.wait(timeout=240)
            assert code == 0, f"compile child failed:\n{log.read_text()[-4000:]}"
            for row, figures in zip(share, json.loads(results.read_text()), strict=True):
                row.regs, row.spills, row.shared, row.error = figures


Compiled = tuple[list[Compile], tuple[Compile, Compile]]  # the project's, and _forced's


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiled]:
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        binder = _Binder(mp)
        for shape in SHAPES:
            for dtype in DTYPES:
                # float32 takes the fixed-shape step only: for the kernels the eager one differs
                # in the block table's row stride alone, and float32 attention compiles slowest
                for graph_step in (True,) if dtype == torch.float32 else (False, True):
                    for block_size in BLOCK_SIZES:
                        step = "graph" if graph_step else "eager"
                        name = str(dtype).removeprefix("torch.")
                        binder.case = f"{shape.name} {name} bs{block_size} {step}"
                        _decode_layer(shape, dtype, block_size, graph_step)
    rows = list(binder.compiles.values())
    bound = time.perf_counter() - start
    forced = _forced(rows)
    _compile_all([*rows, *forced], tmp_path_factory.mktemp("triton-cache"))
    elapsed = time.perf_counter() - start
    print(f"\n{len(rows)} specializations, bound in {bound:.1f} s, compiled by {elapsed:.1f} s")
    print(table(rows))
    yield rows, forced


@pytest.mark.parametrize("path", sorted(KERNELS))
def test_kernel_compiles_within_limits(compiled: Compiled, path: str) -> None:
    kernel = path.rpartition(".")[2]
    rows = [r for r in compiled[0] if r.kernel == kernel]
    assert rows, f"no driven step launched {path}: add its caller to _decode_layer"
    bad = [f"sm_{r.arch} {r.dtype} {r.spec}: {'; '.join(v)}" for r in rows if (v := violations(r))]
    assert not bad, "\n".join(bad) + "\n" + table(rows)


def test_forced_spill_and_error_are_seen(compiled: Compiled) -> None:
    """The checks see real figures: a kernel held below the registers it needs shows local
    memory, and a compile that raises comes back as an error, not as a crash or a pass."""
    spill, error = compiled[1]
    assert spill.error is None and 0 < spill.regs <= 64 and spill.spills > 0, table([spill])
    assert violations(spill) == [f"{spill.spills} spilled registers"]
    assert error.error is not None and "num_warps" in error.error, error.error


def test_violations_flag_each_limit() -> None:
    def row(arch: int, dtype: str, spills: int = 0, shared: int = 0) -> Compile:
        return Compile("k", arch, dtype, "", "", ["case"], 32, spills, shared)

    assert violations(row(80, "bf16", shared=166_912)) == []
    assert violations(row(90, "fp16", shared=232_448)) == []
    assert violations(row(80, "bf16", shared=166_913))
    assert violations(row(90, "bf16", shared=232_449))
    assert violations(row(90, "bf16", spills=1)) and violations(row(80, "fp16", spills=1))
    assert violations(row(80, "fp32", spills=8))
    failed = row(90, "bf16")
    failed.error = "PTXASError"
    assert violations(failed) == ["compile error: PTXASError"]


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local memory in 32-bit words) of the one function in a cubin, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        command = [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name]
        usage = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    figures = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage.split("Function", 1)[1]))
    return int(figures["REG"]), (int(figures["STACK"]) + int(figures["LOCAL"])) // 4


def _compile_main(jobs: Path, results: Path) -> None:
    """The child: compile each specialization for its target; [regs, spills, shared, error]."""
    jits: dict[tuple[str, int], JITFunction] = {}
    out: list[list[Any]] = []
    for data in json.loads(jobs.read_text()):
        obj = json.loads(data)
        target = GPUTarget(**obj["target"])
        driver.set_active(cast(Any, _TargetDriver(target)))
        module, _, name = obj["name"].rpartition(".")
        kernel = getattr(importlib.import_module(module), name)
        if (name, target.arch) not in jits:
            jits[name, target.arch] = _fresh_jit(kernel)
        try:
            binary = jits[name, target.arch].preload(data)
            out.append([*_resources(binary.asm["cubin"]), binary.metadata.shared, None])
        except Exception as e:  # reported per compile, beside the rest of the table
            lines = f"{type(e).__name__}: {e}".strip().splitlines()
            out.append([0, 0, 0, " | ".join(lines[:6])])
    results.write_text(json.dumps(out))


if __name__ == "__main__":
    _compile_main(Path(sys.argv[1]), Path(sys.argv[2]))
