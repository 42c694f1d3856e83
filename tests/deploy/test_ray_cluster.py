"""RayCluster end to end on a local Ray cluster (127.0.0.1): one prefill instance at TP=2 (two
actors in one STRICT_PACK group) and two decode instances, driven by a real gRPC client.

One cluster for the module (start-up dominates the time); the test that kills an actor runs last.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
import ray

from deploy.cli.client import fetch_metrics, format_status, parse_metrics
from deploy.runtime.ray.cluster import RayCluster, WorkerStatus
from deploy.runtime.ray.node import process_is_running
from kv_transfer.send_handle import SPLIT_MIN_BYTES_ENV
from tests.deploy.ray_support import (
    hf_greedy,
    kill_the_busiest,
    make_prompts,
    non_loopback_listeners,
    serve_spec,
    start_streams,
    stream_all,
    tiny_model_with_tokenizer,
    wait_restarted,
)
from tests.workers.test_disaggregated import shared_memory_of
from worker.protocol import Role

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

MAX_TOKENS = 12
PROMPTS = make_prompts(tuple(3 + (7 * i) % 41 for i in range(32)), seed=3)
LONG_MAX_TOKENS = 400  # streams that are still running when an actor is killed
LONG_PROMPTS = make_prompts((9, 14, 5, 11, 20, 7, 16, 12), seed=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("ray_cluster"))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, list[list[int]]]:
    return {
        "short": hf_greedy(model_dir, PROMPTS, MAX_TOKENS),
        "long": hf_greedy(model_dir, LONG_PROMPTS, LONG_MAX_TOKENS),
    }


@pytest.fixture(scope="module")
def cluster(model_dir: str) -> Iterator[RayCluster]:
    spec = serve_spec(
        model_dir,
        dtype="float64",
        prefill={"tensor_parallel_size": 2},
        decode={"instances": 2},
        kv_cache={"block_size": 8, "num_blocks": 256},
        scheduler={"max_num_batched_tokens": 256, "chunk_size": 32},
        kv_transfer={"transfer_timeout_s": 5.0},
        router={"worker_timeout_s": 5.0, "shutdown_grace_s": 1.0, "metrics_port": 0},
    )
    ray_cluster = RayCluster(spec)
    progress: list[str] = []
    try:
        # Every same-node transfer splits its copy, as large ones do (this model's are small):
        # Ray's processes inherit the variable from the node this starts.
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(SPLIT_MIN_BYTES_ENV, "0")
            ray_cluster.start(progress=progress.append)
        assert progress[0] == "starting Ray" and progress[-1].startswith("ready on 127.0.0.1:")
        yield ray_cluster
    finally:
        pids = ray_cluster.pids()
        ray_cluster.shutdown()
    assert not ray.is_initialized()
    assert [pid for pid in pids if process_is_running(pid)] == []


def test_32_concurrent_streams_equal_transformers(cluster: RayCluster, reference) -> None:
    results = stream_all(cluster.address, PROMPTS, MAX_TOKENS)
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(PROMPTS)
    assert [r.token_ids for r in results] == reference["short"]
    # The KV moved through the same-node transport (the default on one node): each prefill
    # rank actor shared its cache through /dev/shm, and each decode actor its own, which the
    # prefill ranks wrote their share into. Every pool is back to its size.
    status = cluster.status()
    assert all(shared_memory_of(pid) for worker in status.workers for pid in worker.pids)
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        loads = [w.load for w in cluster.status().workers]
        if all(
            load is not None and load.num_free_blocks == load.num_total_blocks for load in loads
        ):
            break
        time.sleep(0.2)
    assert [
        (w.load.num_free_blocks, w.load.num_total_blocks) for w in cluster.status().workers
    ] == [(256, 256)] * 3


def test_status_shows_every_worker_and_its_placement(cluster: RayCluster) -> None:
    status = cluster.status()
    assert status.serving and status.router_address == cluster.address
    by_id = {worker.instance_id: worker for worker in status.workers}
    assert sorted(by_id) == ["decode-0", "decode-1", "prefill-0"]
    assert [by_id["prefill-0"].role, by_id["decode-0"].role] == [Role.PREFILL, Role.DECODE]
    assert [len(by_id[i].pids) for i in sorted(by_id)] == [1, 1, 2]  # TP=2: two rank actors
    for worker in status.workers:
        assert worker.healthy and worker.error is None and worker.node_ip == "127.0.0.1"
        assert worker.load is not None and worker.load.num_total_blocks == 256
        assert set(worker.pids) <= set(status.ray_pids)  # Ray's processes, so shut down by id
    # one torch thread per worker, each pinned to its own core set
    for worker in status.workers:
        for pid in worker.pids:
            assert len(os.sched_getaffinity(pid)) == 1


def test_every_listening_socket_is_on_loopback(cluster: RayCluster) -> None:
    pids = [os.getpid(), *cluster.pids()]  # the driver, GCS, raylet, agents, every actor
    assert len(pids) >= 8
    assert non_loopback_listeners(pids) == []


def test_streams_of_a_killed_decode_actor_migrate_and_it_is_restarted(
    cluster: RayCluster, reference
) -> None:
    threads, results = start_streams(cluster.address, LONG_PROMPTS, LONG_MAX_TOKENS)
    # The router spreads streams by free KV blocks, so which decode instance holds the most is
    # a matter of timing: kill the one that reports the most running streams.
    decodes = [w for w in cluster.status().workers if w.role == Role.DECODE]
    victim = kill_the_busiest(cluster, decodes)
    name = victim.instance_id
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(30)
    assert time.monotonic() - killed_at < 30
    # Its streams move to the other decode instance (prompt plus the tokens already sent,
    # prefilled again) and finish token for token as transformers does.
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == reference["long"]
    assert cluster.router is not None  # the router runs in this process
    registry = cluster.router.metrics.registry
    migrations = registry.get_sample_value("pdserve:request_migrations_total")
    assert migrations is not None and migrations >= 1, f"{name} held none of the streams"

    # Ray restarts the actor; once it reports healthy the router uses it again.
    wait_restarted(cluster, victim)
    results = stream_all(cluster.address, PROMPTS[:16], MAX_TOKENS)
    assert [r.code for r in results] == [grpc.StatusCode.OK] * 16
    assert [r.token_ids for r in results] == reference["short"][:16]
    assert not process_is_running(victim.pids[0])


def test_killed_prefill_driver_is_restarted_with_a_fresh_tp_group(
    cluster: RayCluster, reference
) -> None:
    before = next(w for w in cluster.status().workers if w.instance_id == "prefill-0")
    os.kill(before.pids[0], signal.SIGKILL)  # rank 0; Ray restarts it, it replaces rank 1
    deadline = time.monotonic() + 90
    _wait_for_a_fresh_prefill(cluster, before, deadline)
    while not cluster.serving():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    _serves_exact_outputs_and_the_old_processes_are_gone(cluster, reference, before)


def _wait_for_a_fresh_prefill(cluster: RayCluster, before: WorkerStatus, deadline: float) -> None:
    """prefill-0 healthy again, with two processes none of which is the old group's."""
    while True:
        after = next(w for w in cluster.status().workers if w.instance_id == "prefill-0")
        if after.healthy and len(after.pids) == 2 and not set(after.pids) & set(before.pids):
            return
        assert time.monotonic() < deadline, f"prefill-0 not back: {after}"
        time.sleep(0.2)


def _serves_exact_outputs_and_the_old_processes_are_gone(
    cluster: RayCluster, reference: dict[str, list[list[int]]], before: WorkerStatus
) -> None:
    results = stream_all(cluster.address, PROMPTS[:16], MAX_TOKENS)
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * 16
    assert [r.token_ids for r in results] == reference["short"][:16]
    deadline = time.monotonic() + 10
    while any(process_is_running(pid) for pid in before.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in before.pids if process_is_running(pid)] == []


def _router_says_healthy(metrics_address: str, instance_id: str) -> bool:
    status = parse_metrics(fetch_metrics(metrics_address))
    return any(w.instance_id == instance_id and w.healthy >= 1.0 for w in status.workers)


def test_killed_tp_rank_shows_its_instance_down_and_ray_restarts_it(
    cluster: RayCluster, reference
) -> None:
    """The driver notices its dead rank, exits so that Ray restarts it
    (alive but broken it would stay down for good), and the router's metrics (what `pdserve
    status` shows) say down at once and healthy again after the restart."""
    metrics = f"127.0.0.1:{cluster.metrics_port}"
    deadline = time.monotonic() + 30
    while not _router_says_healthy(metrics, "prefill-0"):
        assert time.monotonic() < deadline, "prefill-0 never healthy before the kill"
        time.sleep(0.1)
    before = next(w for w in cluster.status().workers if w.instance_id == "prefill-0")
    os.kill(before.pids[1], signal.SIGKILL)  # TP rank 1's actor, not the driver
    killed_at = time.monotonic()
    while _router_says_healthy(metrics, "prefill-0"):
        assert time.monotonic() - killed_at < 5, "the router still shows prefill-0 healthy"
        time.sleep(0.05)
    table = format_status(cluster.address, "NOT_SERVING", parse_metrics(fetch_metrics(metrics)))
    assert any(row.startswith("prefill-0") and "UNHEALTHY" in row for row in table.splitlines())
    deadline = killed_at + 90
    _wait_for_a_fresh_prefill(cluster, before, deadline)
    while not (cluster.serving() and _router_says_healthy(metrics, "prefill-0")):
        assert time.monotonic() < deadline, "the router never showed prefill-0 healthy again"
        time.sleep(0.1)
    _serves_exact_outputs_and_the_old_processes_are_gone(cluster, reference, before)
