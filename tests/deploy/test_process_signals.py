"""Worker processes ignore terminal signals and obey their parent.

A stand-in for `pdserve serve --no-ray` runs in a session of its own and hosts a prefill worker at
TP=2 (a ProcessWorker child, which spawns TP rank 1). SIGINT and SIGTERM to the whole process
group (Ctrl-C, systemd's stop) leave the worker and its rank running and answering: stopping them
is the parent's job. When the parent dies (SIGKILL), the worker and its rank exit on their own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from deploy.runtime.local.process_host import ProcessWorker
from engine.config import EngineConfig
from tests.engine.test_tp_idle import _alive
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Load, ProcessIds

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers


def _noted(signum: int, frame: object) -> None:
    pass


def _serve_stand_in(model_dir: str, commands: mp.Queue, answers: mp.Queue) -> None:
    os.setsid()
    for signum in (signal.SIGINT, signal.SIGTERM):  # the real serve drains; this one just stays
        signal.signal(signum, _noted)  # a handler, not SIG_IGN: children would inherit that
    engine = EngineConfig(model_dir, tensor_parallel_size=2, block_size=8, num_kv_blocks=16)
    worker = ProcessWorker(Worker, WorkerConfig.prefill(engine), "prefill-0", name="prefill-0")
    answers.put(worker.call(ProcessIds()))
    while True:
        commands.get()
        answers.put(worker.call(Load()).healthy)


def test_workers_ignore_group_signals_and_exit_with_their_parent(tiny_model) -> None:
    context = mp.get_context("spawn")
    commands, answers = context.Queue(), context.Queue()
    parent = context.Process(target=_serve_stand_in, args=(tiny_model("llama"), commands, answers))
    parent.start()
    try:
        children = answers.get(timeout=120)  # [worker process, its TP rank]
        assert len(children) == 2
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            os.killpg(parent.pid, signum)  # type: ignore[arg-type]
            time.sleep(0.3)
        assert [_alive(pid) for pid in children] == [True, True]
        commands.put("load")
        assert answers.get(timeout=30) is True
        os.kill(parent.pid, signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        parent.kill()
        parent.join(10)
