"""Every thread that touches CUDA makes its rank's GPU its current device first.

CUDA's current device belongs to each thread and starts at 0, so a step, a KV send or an NCCL
group built on a fresh thread of a rank on cuda:N would use GPU 0 with GPU N's memory. The calls
are recorded through `torch.cuda.set_device`; a scan checks that the packages on the data path
start their threads through `device_thread` only."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch

from engine.rank_device import device_thread
from kv_transfer.posters import POSTERS
from worker.loop import WorkerLoop

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA_PATH = ("engine", "kv_transfer", "worker", "prefill_worker", "decode_worker")
THREAD_STARTS = {"threading.Thread", "Thread", "ThreadPoolExecutor"}
BINDS_ITSELF = {
    "engine/rank_device.py",  # device_thread
    "kv_transfer/posters.py",  # shared threads: each job binds its rank's device (tested here)
    "engine/step_queue.py",  # the TP driver's liveness check reads the TP store, never CUDA
    "engine/structured/grammars.py",  # compiles grammars: CPU work, never CUDA
}
GPU = torch.device("cuda", 1)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.device]]:
    recorded: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: recorded.append((threading.current_thread().name, torch.device(device))),
    )
    return recorded


def test_a_device_thread_binds_before_it_runs(calls: list[tuple[str, torch.device]]) -> None:
    seen: list[int] = []
    thread = device_thread(GPU, lambda: seen.append(len(calls)), "bound")
    thread.start()
    thread.join(5)
    assert calls == [("bound", GPU)] and seen == [1]  # bound before the body ran


def test_a_poster_job_binds_its_own_device(calls: list[tuple[str, torch.device]]) -> None:
    done = threading.Event()
    POSTERS.run(done.set, GPU)
    assert done.wait(5)
    assert calls and calls[-1][1] == GPU and calls[-1][0] == "kv-send"


def test_the_worker_loop_thread_binds_the_engine_device(
    calls: list[tuple[str, torch.device]],
) -> None:
    class Idle(WorkerLoop):
        def step(self) -> bool:
            return False

    loop = Idle("gpu-worker")
    loop.device = GPU
    loop.start()
    try:
        assert loop.call(lambda: threading.current_thread().name) == "pdserve-gpu-worker"
    finally:
        loop.stop()
    assert ("pdserve-gpu-worker", GPU) in calls


def test_no_data_path_thread_starts_unbound() -> None:
    unbound = []
    for package in DATA_PATH:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for call in ast.walk(ast.parse(path.read_text())):
                if isinstance(call, ast.Call) and ast.unparse(call.func) in THREAD_STARTS:
                    if where not in BINDS_ITSELF:
                        unbound.append(f"{where}:{call.lineno}")
    assert unbound == []
