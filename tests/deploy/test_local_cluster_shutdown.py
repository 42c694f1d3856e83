"""LocalCluster's shutdown does not wait for a restart in progress (a whole model load): it kills
the process being started, returns within seconds and leaves no process behind. And a worker
that cannot start is retried with a growing backoff, not on every tick."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.local_cluster import LocalCluster, RestartBackoff
from engine import EngineConfig
from router.config import RouterConfig
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model
from worker.config import WorkerConfig

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers


def _spawned_children() -> set[int]:
    """This process's live children started by multiprocessing's spawn (worker processes)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"spawn_main" in command:
            pids.add(int(entry))
    return pids


def test_shutdown_during_a_restart_kills_the_new_process_and_returns_at_once(
    tmp_path: os.PathLike[str],
) -> None:
    model_dir = add_tiny_tokenizer(make_tiny_model(tmp_path, "llama"))
    engine = EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=64)
    spec = ClusterSpec(
        router=RouterConfig(model_dir=model_dir, shutdown_grace_s=1.0),
        prefill=WorkerConfig.prefill(engine),
        num_prefill_instances=1,
        decode=WorkerConfig.decode(engine),
        num_decode_instances=1,
    )
    before = _spawned_children()
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        os.kill(cluster.workers["decode-0"].pid, signal.SIGKILL)
        time.sleep(0.5)  # the watch thread has begun the restart (it polls every 0.2 s)
    finally:
        began = time.monotonic()
        cluster.shutdown()
        took_s = time.monotonic() - began
    assert cluster.num_restarts == {}, "shutdown waited for the restart to finish"
    assert took_s < 15.0
    deadline = time.monotonic() + 5.0
    while _spawned_children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _spawned_children() - before, "a worker process outlived the cluster"


def test_a_failing_restart_backs_off_doubling_up_to_30_s() -> None:
    now = [100.0]
    backoff = RestartBackoff(clock=lambda: now[0])
    assert backoff.due("decode-0")  # the first restart: at once
    delays = [backoff.failed("decode-0") for _ in range(7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert not backoff.due("decode-0")
    now[0] += 29.9
    assert not backoff.due("decode-0") and backoff.due("prefill-0")
    now[0] += 0.1
    assert backoff.due("decode-0")
    backoff.succeeded("decode-0")
    assert backoff.failed("decode-0") == 1.0  # a worker that served starts over
