"""The router over a real disaggregated cluster (a prefill and a decode worker in plain
processes, deploy/runtime/local/local_cluster.py): a request_id reused right after a cancel, or by two clients
at once, never mixes up attempts; and streams already decoding survive the prefill's death.

The processes are shared by the module (start-up dominates the time on 2 cores); the last test
kills the prefill worker.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.local_cluster import LocalCluster
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer.config import KVTransferConfig
from router.config import RouterConfig
from worker.config import WorkerConfig

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 128
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [1, 99, 98, 97]]
MAX_TOKENS = 12
LONG_MAX_TOKENS = 480  # decoding takes a while: long enough to kill the prefill meanwhile
NUM_REUSES = 8


def _engine(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )


@pytest.fixture(scope="module")
def expected(tiny_model_dir: str) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens by (prompt index, max_tokens), from the engine in this process."""
    with LLM(tiny_model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=256) as llm:
        out = {}
        for max_tokens in (MAX_TOKENS, LONG_MAX_TOKENS):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            for index, result in enumerate(llm.generate(PROMPTS, params)):
                out[index, max_tokens] = result.token_ids
        return out


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[LocalCluster]:
    kv = KVTransferConfig(transfer_timeout_s=10.0)
    spec = ClusterSpec(
        # A request that finds no prefill waits 2 s for one to come back (none does here).
        router=RouterConfig(
            model_dir=tiny_model_dir, load_refresh_interval_s=0.05, recovery_wait_s=2.0
        ),
        prefill=WorkerConfig.prefill(_engine(tiny_model_dir), kv),
        num_prefill_instances=1,
        decode=WorkerConfig.decode(_engine(tiny_model_dir), kv),
        num_decode_instances=1,
    )
    # No restarts: the last test kills the prefill and expects it to stay down.
    with LocalCluster(spec, restart_workers=False) as running:
        running.start()
        yield running


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def _request(index: int, max_tokens: int, request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=PROMPTS[index], max_tokens=max_tokens, ignore_eos=True, request_id=request_id
    )


def _collect(responses: Iterator[pb.GenerateResponse]) -> tuple[list[int], int, set[str]]:
    """(token ids, finish reason, the request ids the responses carried)."""
    token_ids: list[int] = []
    finish_reason = pb.FINISH_REASON_UNSPECIFIED
    ids = set()
    for response in responses:
        token_ids += response.token_ids
        finish_reason = response.finish_reason
        ids.add(response.request_id)
    return token_ids, finish_reason, ids


def _wait_for_free_pools(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = cluster.status()
        if all(load.num_free_blocks == load.num_total_blocks for load in loads):
            return
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still held: {cluster.status()}")


def test_reusing_a_request_id_right_after_cancelling_it_gets_the_right_tokens(
    cluster: LocalCluster, stub: pb_grpc.GenerationStub, expected: dict
) -> None:
    for attempt in range(NUM_REUSES):
        old = stub.Generate(_request(attempt % 2, LONG_MAX_TOKENS, "reused"), timeout=60)
        for _ in range(1 + attempt % 3):  # cancel at the first token, or while decoding
            next(old)
        old.cancel()
        index = (attempt + 1) % 2  # another prompt: the old attempt's tokens would show
        token_ids, finish_reason, ids = _collect(
            stub.Generate(_request(index, MAX_TOKENS, "reused"), timeout=60)
        )
        assert (token_ids, finish_reason) == (expected[index, MAX_TOKENS], pb.FINISH_REASON_LENGTH)
        assert ids == {"reused"}  # the client's id, not the worker-side one
    _wait_for_free_pools(cluster)


def test_timings_stages_add_up_and_the_transfer_is_the_transfer(
    cluster: LocalCluster, stub: pb_grpc.GenerationStub, expected: dict
) -> None:
    """Each stage is measured once, where it happens: router queue, prefill queue and compute,
    the KV's hand-off to landing, decode queue and decode add up to the end-to-end time (less
    the router-to-worker call hops). A small prompt's transfer is milliseconds (the KV benchmark
    moves 64 tokens in under 2 ms), not the prefill that used to be counted in it."""
    for index in range(len(PROMPTS)):
        responses = list(stub.Generate(_request(index, MAX_TOKENS, f"timed-{index}"), timeout=60))
        timings = responses[-1].timings
        stages = (
            timings.router_queue_s
            + timings.prefill_queue_s
            + timings.prefill_s
            + timings.kv_transfer_s
            + timings.decode_queue_s
            + timings.decode_s
        )
        assert 0.0 < timings.kv_transfer_s < 0.1, timings
        assert timings.prefill_s > 0.0 and timings.decode_s > 0.0, timings
        assert timings.decode_queue_s >= 0.0, timings  # KV landing in a step: decoded in it
        assert stages <= timings.e2e_s + 1e-3, timings
        assert stages >= timings.e2e_s - max(0.05, 0.2 * timings.e2e_s), timings
        assert timings.first_token_s >= timings.router_queue_s + timings.prefill_s, timings


def test_two_concurrent_requests_with_one_id_are_both_served(
    cluster: LocalCluster, stub: pb_grpc.GenerationStub, expected: dict
) -> None:
    results: dict[int, tuple[list[int], int, set[str]]] = {}

    def run(index: int) -> None:
        results[index] = _collect(stub.Generate(_request(index, MAX_TOKENS, "twin"), timeout=60))

    threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for index in (0, 1, 2):
        assert results[index] == (
            expected[index, MAX_TOKENS],
            pb.FINISH_REASON_LENGTH,
            {"twin"},
        )
    _wait_for_free_pools(cluster)


def test_streams_already_decoding_survive_the_prefill_s_death(
    cluster: LocalCluster, stub: pb_grpc.GenerationStub, expected: dict
) -> None:
    calls = [
        stub.Generate(_request(index, LONG_MAX_TOKENS, f"long-{index}"), timeout=60)
        for index in range(len(PROMPTS))
    ]
    firsts = [[*next(call).token_ids, *next(call).token_ids] for call in calls]  # decoding now
    os.kill(cluster.workers["prefill-0"].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for index, (call, first) in enumerate(zip(calls, firsts, strict=True)):
        token_ids, finish_reason, _ids = _collect(call)
        assert first + token_ids == expected[index, LONG_MAX_TOKENS]
        assert finish_reason == pb.FINISH_REASON_LENGTH
    # The router did notice, at once: the metrics show the prefill down and holding nothing,
    # and new requests have no prefill instance to go to.
    assert cluster.router is not None
    registry = cluster.router.metrics.registry
    labels = {"instance": "prefill-0", "role": "prefill"}
    while registry.get_sample_value("pdserve:worker_healthy", labels) != 0:
        assert time.monotonic() - killed_at < 2.0, "prefill-0 still shows as healthy"
        time.sleep(0.01)
    assert registry.get_sample_value("pdserve:worker_num_requests_running", labels) == 0
    with pytest.raises(grpc.RpcError) as error:
        stub.GenerateUnary(_request(0, MAX_TOKENS, "after"), timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
