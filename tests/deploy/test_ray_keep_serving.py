"""The colocated and adaptive layouts keep serving on Ray as the disaggregated one does
(tests/deploy/test_ray_cluster.py): idle time past every deadline, a request id reused after a
cancel, and a worker actor SIGKILLed mid-stream, restarted by Ray while its streams migrate.

One cluster per mode (two instances at TP=1, float64, so a migrated greedy stream must equal
transformers' exactly), with the KV deadlines shortened to 2 s, so that an idle pause longer
than them shows what a pause of minutes shows with the defaults (benchmarks/chaos.py's
`--runtime ray` run covers the same faults under load).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.ray.cluster import RayCluster
from deploy.runtime.ray.node import process_is_running
from tests.deploy.ray_support import (
    hf_greedy,
    kill_the_busiest,
    make_prompts,
    serve_spec,
    start_streams,
    stream_all,
    tiny_model_with_tokenizer,
    wait_restarted,
)

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

SHORT_S = 2.0  # both KV deadlines
NUM_BLOCKS = 128
MAX_TOKENS = 8
PROMPTS = make_prompts((5, 13, 22, 9, 31, 17), seed=11)
LONG_MAX_TOKENS = 300  # streams still running when an actor is killed
LONG_PROMPTS = make_prompts((9, 14, 5, 11, 20, 7), seed=4)
PROFILE = str(Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json")
LAYOUTS = {
    "colocated": {"mode": "colocated", "colocated": {"instances": 2}},
    "adaptive": {"mode": "adaptive", "adaptive": {"instances": 2}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("ray_keep"))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, list[list[int]]]:
    return {
        "short": hf_greedy(model_dir, PROMPTS, MAX_TOKENS),
        "long": hf_greedy(model_dir, LONG_PROMPTS, LONG_MAX_TOKENS),
    }


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request: pytest.FixtureRequest, model_dir: str) -> Iterator[RayCluster]:
    spec = serve_spec(
        model_dir,
        **LAYOUTS[request.param],
        dtype="float64",
        kv_cache={"block_size": 8, "num_blocks": NUM_BLOCKS},
        kv_transfer={"transfer_timeout_s": SHORT_S, "start_timeout_s": SHORT_S},
        router={"worker_timeout_s": 5.0, "shutdown_grace_s": 1.0, "latency_profile": PROFILE},
    )
    ray_cluster = RayCluster(spec)
    try:
        ray_cluster.start()
        yield ray_cluster
    finally:
        pids = ray_cluster.pids()
        ray_cluster.shutdown()
    assert not ray.is_initialized()
    assert [pid for pid in pids if process_is_running(pid)] == []


def _serves_exactly(cluster: RayCluster, reference: dict[str, list[list[int]]]) -> None:
    results = stream_all(cluster.address, PROMPTS, MAX_TOKENS)
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(PROMPTS)
    assert [r.token_ids for r in results] == reference["short"]


def _pools_back(cluster: RayCluster) -> None:
    deadline = time.monotonic() + 15.0
    while True:
        loads = [w.load for w in cluster.status().workers]
        free = [load.num_free_blocks if load else None for load in loads]
        if free == [NUM_BLOCKS] * len(loads):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {free}"
        time.sleep(0.2)


def test_idle_past_every_deadline_then_serves_the_same_tokens(cluster: RayCluster, reference):
    _serves_exactly(cluster, reference)
    time.sleep(3 * SHORT_S)
    assert all(w.healthy for w in cluster.status().workers)
    _serves_exactly(cluster, reference)
    _pools_back(cluster)


def test_a_request_id_reused_after_a_cancel_gets_its_own_answer(cluster: RayCluster, reference):
    with grpc.insecure_channel(cluster.address) as channel:
        generation = pb_grpc.GenerationStub(channel)
        first = pb.GenerateRequest(
            token_ids=LONG_PROMPTS[0], max_tokens=LONG_MAX_TOKENS, ignore_eos=True, request_id="x"
        )
        call = generation.Generate(first, timeout=60)
        next(iter(call))  # running: its first token came
        call.cancel()
        second = pb.GenerateRequest(
            token_ids=PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True, request_id="x"
        )
        tokens = [t for r in generation.Generate(second, timeout=60) for t in r.token_ids]
    assert tokens == reference["short"][1]
    _pools_back(cluster)


def test_streams_of_a_killed_actor_migrate_and_ray_restarts_it(cluster: RayCluster, reference):
    threads, results = start_streams(cluster.address, LONG_PROMPTS, LONG_MAX_TOKENS)
    victim = kill_the_busiest(cluster, cluster.status().workers)
    for thread in threads:
        thread.join(60)
    # its streams move to the other instance and finish token for token as transformers does
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == reference["long"]
    assert cluster.router is not None  # the router runs in this process
    migrations = cluster.router.metrics.registry.get_sample_value(
        "pdserve:request_migrations_total"
    )
    assert migrations is not None and migrations >= 1, f"{victim.instance_id} held no stream"
    # Ray restarts the actor (it rebuilds its KV channels first); the router uses it again
    wait_restarted(cluster, victim)
    _serves_exactly(cluster, reference)
    _pools_back(cluster)
    assert not process_is_running(victim.pids[0])
