"""An idle TP group stays up; a dead driver or a dead rank is still noticed.

The TP group's collective timeout (`tp_timeout_s`) is shortened to 2 s, and the group idles for
well past it: an idle rank waits for its next step without a deadline, so the next step runs and
gives the same tokens. Liveness goes the other way too: a rank whose driver was SIGKILLed exits
within seconds, and a driver notices a dead rank while idle (`check_ranks`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from engine.config import EngineConfig
from engine.executor import Executor
from tests.engine.greedy_loop import greedy_generate
from tests.engine.test_model_parity import make_prompts

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

GROUP_TIMEOUT_S = 2.0


def tp2_config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=16,
        tp_timeout_s=GROUP_TIMEOUT_S,
    )


def test_idle_group_outlives_its_collective_timeout_and_then_serves(tiny_model) -> None:
    with Executor(tp2_config(tiny_model("llama"))) as executor:
        prompts = make_prompts(executor.model_config.vocab_size, (6, 11))
        before = [r.token_ids for r in greedy_generate(executor, prompts, 3)]
        time.sleep(2.5 * GROUP_TIMEOUT_S)
        (pid,) = executor.worker_pids
        assert _alive(pid), "the idle TP rank died"
        executor.check_ranks()
        after = [r.token_ids for r in greedy_generate(executor, prompts, 3)]
    assert after == before


def test_driver_notices_a_dead_rank_while_idle(tiny_model) -> None:
    with Executor(tp2_config(tiny_model("llama"))) as executor:
        executor.check_ranks()
        (pid,) = executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                executor.check_ranks()
            except RuntimeError as exc:
                assert "TP rank 1" in str(exc)
                break
            time.sleep(0.05)
        else:
            pytest.fail("check_ranks did not notice the dead rank")


def _driver(model_dir: str, pids: mp.Queue) -> None:
    executor = Executor(tp2_config(model_dir))
    pids.put(executor.worker_pids[0])
    time.sleep(120)  # killed by the test long before


def test_a_rank_exits_when_its_driver_dies(tiny_model) -> None:
    context = mp.get_context("spawn")
    pids = context.Queue()
    driver = context.Process(target=_driver, args=(tiny_model("llama"), pids))
    driver.start()
    try:
        rank_pid = pids.get(timeout=60)
        time.sleep(0.5)
        assert _alive(rank_pid)
        os.kill(driver.pid, signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while _alive(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank_pid), "the TP rank outlived its driver"
    finally:
        driver.kill()
        driver.join(10)


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_driver_that_ends_with_os_exit_leaves_no_semaphore_behind(tiny_model) -> None:
    """A driver process ends with os._exit (no finalizers run): the queue its ranks reported
    ready on must not hold named semaphores by then, or each restart leaves three in /dev/shm
    until the resource tracker's exit warns about them."""
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from engine.config import EngineConfig\n"
        "from engine.executor import Executor\n"
        "config = EngineConfig(model_dir=sys.argv[1], tensor_parallel_size=2, block_size=8,"
        " num_kv_blocks=16)\n"
        "executor = Executor(config)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, tiny_model()], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked semaphore" not in done.stderr, done.stderr[-2000:]
