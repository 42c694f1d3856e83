"""A request the decode pool has no KV space for waits in the router's queue, not refused.

Eight concurrent long prompts on a decode pool that holds four: all finish, the last ones later,
over HTTP and gRPC (the dispatch they share), with synthetic workers and with a real cluster in
plain processes. Only the admission bounds (a queue place is needed to wait) or the request's
deadline end a wait with 429 / RESOURCE_EXHAUSTED (or DEADLINE_EXCEEDED); a prompt no pool
could ever hold is refused at once.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.local_cluster import LocalCluster
from engine import EngineConfig
from kv_transfer.config import KVTransferConfig
from router.config import RouterConfig
from router.server import Router
from router.synthetic import synthetic_cluster
from tests.router.harness import RouterThread
from worker.config import WorkerConfig

NUM_REQUESTS = 8
# Synthetic decode: prompt + max_tokens = 112 + 16 tokens = 8 blocks of 16; 32 blocks hold 4.
SYNTHETIC_BLOCKS = 32
SYNTHETIC_PROMPT = [7] * 112
SYNTHETIC_MAX_TOKENS = 16


def _http_completion(port: int, model: str, body: dict[str, Any]) -> tuple[int, float, str]:
    """(status, seconds to the answer, error message) of one whole completion."""
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps({"model": model, **body}).encode()
        connection.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    message = answer.get("error", {}).get("message", "") if response.status != 200 else ""
    return response.status, time.monotonic() - started, message


def _concurrently(call: Any, num: int, router: Router) -> tuple[list[Any], int]:
    """The calls' results, and how many requests waited in the router's queue meanwhile: the
    parks for KV space counted by admission, or the most queued at once (sampled)."""
    most_queued, parks_before = 0, router.admission.num_parks_total
    with ThreadPoolExecutor(num) as pool:
        futures = [pool.submit(call) for _ in range(num)]
        while not all(future.done() for future in futures):
            most_queued = max(most_queued, router.admission.num_waiting)
            time.sleep(0.005)
    most_queued = max(most_queued, router.admission.num_parks_total - parks_before)
    return [future.result() for future in futures], most_queued


def _assert_all_finish(results: list[tuple[Any, float, str]], ok: Any, most_queued: int) -> None:
    assert [r[0] for r in results] == [ok] * len(results), results
    assert most_queued >= 1  # some waited in the router's queue: the pool holds only half


def _assert_the_last_start_when_the_first_end(decode: Any) -> None:
    """Each of the second four got its KV space only once one of the first four had ended."""
    times = decode.emit_times.values()
    firsts = sorted(emitted[0] for emitted in times)
    lasts = sorted(emitted[-1] for emitted in times)
    assert len(firsts) == NUM_REQUESTS
    for k in range(NUM_REQUESTS // 2, NUM_REQUESTS):
        assert firsts[k] >= lasts[k - NUM_REQUESTS // 2], (firsts, lasts)


@pytest.fixture
def synthetic(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05)
    make = lambda: synthetic_cluster(  # noqa: E731
        1, 1, num_blocks=SYNTHETIC_BLOCKS, step_interval_s=0.02, record_emit_times=True
    )
    with RouterThread(config, make) as running:
        yield running


def _router(server: RouterThread) -> Router:
    assert server.router is not None
    return server.router


def _port_and_model(server: RouterThread) -> tuple[int, str]:
    assert server.router is not None and server.router.http_port is not None
    return server.router.http_port, server.router.config.model_name


def test_http_requests_past_the_kv_pool_wait_and_all_finish(synthetic: RouterThread) -> None:
    port, model = _port_and_model(synthetic)
    body = {"prompt": SYNTHETIC_PROMPT, "max_tokens": SYNTHETIC_MAX_TOKENS, "ignore_eos": True}
    results, most_queued = _concurrently(
        lambda: _http_completion(port, model, body), NUM_REQUESTS, _router(synthetic)
    )
    _assert_all_finish(results, 200, most_queued)
    _assert_the_last_start_when_the_first_end(synthetic.decode_handles[0])
    assert [load.num_free_blocks for load in synthetic.loads()] == [SYNTHETIC_BLOCKS] * 2


def _grpc_unary(address: str, timeout_s: float) -> tuple[grpc.StatusCode, float, str]:
    started = time.monotonic()
    request = pb.GenerateRequest(
        token_ids=SYNTHETIC_PROMPT, max_tokens=SYNTHETIC_MAX_TOKENS, ignore_eos=True
    )
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=timeout_s)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
    return code, time.monotonic() - started, details


def test_grpc_requests_past_the_kv_pool_wait_and_all_finish(synthetic: RouterThread) -> None:
    results, most_queued = _concurrently(
        lambda: _grpc_unary(synthetic.address, 60), NUM_REQUESTS, _router(synthetic)
    )
    _assert_all_finish(results, grpc.StatusCode.OK, most_queued)
    _assert_the_last_start_when_the_first_end(synthetic.decode_handles[0])


def test_a_wait_for_kv_space_ends_at_the_deadline(synthetic: RouterThread) -> None:
    """Four hold the pool for about 0.3 s; the rest give up at a 0.1 s deadline."""
    results, _ = _concurrently(
        lambda: _grpc_unary(synthetic.address, 0.1), NUM_REQUESTS, _router(synthetic)
    )
    codes = [code for code, _, _ in results]
    assert grpc.StatusCode.OK not in codes or codes.count(grpc.StatusCode.OK) <= 4, results
    assert set(codes) - {grpc.StatusCode.OK} <= {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }, results


def test_waiting_for_kv_space_takes_a_queue_place(tiny_model_dir: str) -> None:
    """With two queue places, two of the four that do not fit wait; two get 429 at once."""
    config = RouterConfig(
        model_dir=tiny_model_dir, http_port=0, max_queued_requests=2, load_refresh_interval_s=0.05
    )
    # Steps slow enough (a request holds its space about 2 s) that all eight have arrived before
    # the first ends, even on a loaded machine: a late one would find space and pass.
    make = lambda: synthetic_cluster(  # noqa: E731
        1, 1, num_blocks=SYNTHETIC_BLOCKS, step_interval_s=0.15
    )
    with RouterThread(config, make) as server:
        port, model = _port_and_model(server)
        body = {"prompt": SYNTHETIC_PROMPT, "max_tokens": SYNTHETIC_MAX_TOKENS, "ignore_eos": True}
        results, _ = _concurrently(
            lambda: _http_completion(port, model, body), NUM_REQUESTS, _router(server)
        )
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 6 + [429] * 2, results
    assert all("capacity" in message for status, _, message in results if status == 429)


def test_a_prompt_no_pool_can_hold_is_refused_at_once(tiny_model_dir: str) -> None:
    """Even while another request runs (whose end frees space, but never enough)."""
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05)
    make = lambda: synthetic_cluster(1, 1, num_blocks=24, step_interval_s=0.02)  # noqa: E731
    with RouterThread(config, make) as server, ThreadPoolExecutor(1) as background:
        port, model = _port_and_model(server)
        holder = background.submit(
            _http_completion, port, model, {"prompt": "hold", "max_tokens": 100}
        )
        time.sleep(0.3)  # the holder runs
        body = {"prompt": [7] * (24 * 16 + 1), "max_tokens": 8}  # 25 blocks of prompt
        status, seconds, message = _http_completion(port, model, body)
        assert status == 429 and "full" in message, message
        assert not holder.done() and seconds < 1
        assert holder.result()[0] == 200


# -- a real cluster: the decode worker's own reservation check --------------------------------

BLOCK_SIZE = 8
PROMPT_TOKENS = 200  # 25 blocks; 4 of them and their 32 new tokens each fit 120 blocks, 5 do not
DECODE_BLOCKS = 120
MAX_TOKENS = 32


@pytest.mark.slow
def test_a_real_decode_pool_that_holds_four_serves_eight(tiny_model_dir: str) -> None:
    def engine(num_blocks: int) -> EngineConfig:
        return EngineConfig(
            model_dir=tiny_model_dir,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_blocks,
        )

    kv = KVTransferConfig(transfer_timeout_s=10.0)
    spec = ClusterSpec(
        router=RouterConfig(
            model_dir=tiny_model_dir,
            http_port=0,
            block_size=BLOCK_SIZE,
            load_refresh_interval_s=0.05,
        ),
        prefill=WorkerConfig.prefill(engine(1024), kv),
        num_prefill_instances=1,
        decode=WorkerConfig.decode(engine(DECODE_BLOCKS), kv),
        num_decode_instances=1,
    )
    with LocalCluster(spec) as cluster:
        cluster.start()
        assert cluster.router is not None and cluster.router.http_port is not None
        port, model = cluster.router.http_port, cluster.router.config.model_name
        body = {
            "prompt": [5 + i % 400 for i in range(PROMPT_TOKENS)],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        results, most_queued = _concurrently(
            lambda: _http_completion(port, model, body), NUM_REQUESTS, cluster.router
        )
        _assert_all_finish(results, 200, most_queued)
        times = sorted(seconds for _, seconds, _ in results)
        assert times[-1] > times[0], times  # the last ones later
        failures = cluster.router.metrics.registry.get_sample_value(
            "pdserve:request_failure_total", {"code": "RESOURCE_EXHAUSTED"}
        )
        assert not failures
