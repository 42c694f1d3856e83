"""The router as a gRPC service on 127.0.0.1, in front of synthetic workers (real KV block pools,
made-up tokens): streaming, stop strings, cancellation and deadlines, health, reflection, metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_requests import Client
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from router.tokenizer import RouterTokenizer
from tests.router.harness import RouterThread

NUM_BLOCKS = 24  # 384 tokens per instance, under the model's 512


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, metrics_port=0, load_refresh_interval_s=0.02)

    def make_handles():  # one prefill instance, two decode instances
        return synthetic_cluster(1, 2, num_blocks=NUM_BLOCKS, step_interval_s=0.002)

    with RouterThread(config, make_handles) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: RouterThread) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def _free_blocks(server: RouterThread) -> list[int]:
    return [load.num_free_blocks for load in server.loads()]


def _wait_for_free_blocks(
    server: RouterThread, expected: list[int], timeout_s: float = 5.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while _free_blocks(server) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _free_blocks(server) == expected


def test_listens_on_loopback_only(server: RouterThread) -> None:
    assert server.address.startswith("127.0.0.1:")


def test_streamed_text_equals_unary_text_and_decoding_the_ids(
    stub: pb_grpc.GenerationStub, tokenizer: RouterTokenizer
) -> None:
    request = pb.GenerateRequest(prompt="Le café 我们", max_tokens=40, request_id="stream-1")
    responses = list(stub.Generate(request, timeout=10))
    token_ids = [t for r in responses for t in r.token_ids]
    streamed_text = "".join(r.text for r in responses)
    assert len(token_ids) == 40 and 1 < len(responses) <= 40  # events that queue up merge
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.request_id == "stream-1"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(tokenizer.encode("Le café 我们")),
        40,
    )
    assert 0 < last.timings.first_token_s <= last.timings.e2e_s
    assert last.timings.per_token_s > 0
    # the last message names where the request ran (one prefill and two decode instances here)
    assert last.prefill_instance.startswith("prefill-")
    assert last.decode_instance.startswith("decode-")
    assert all(not r.prefill_instance for r in responses[:-1])
    unary = stub.GenerateUnary(pb.GenerateRequest(prompt="Le café 我们", max_tokens=40), timeout=10)
    assert list(unary.token_ids) == token_ids  # synthetic tokens depend on the prompt only
    assert unary.text == streamed_text == tokenizer.decode(token_ids)


def test_stop_string_split_across_tokens_cuts_the_text_exactly(
    stub: pb_grpc.GenerationStub, tokenizer: RouterTokenizer
) -> None:
    full = stub.GenerateUnary(pb.GenerateRequest(token_ids=[5, 6], max_tokens=60), timeout=10)
    full_text = full.text
    # A stop string that spans a token boundary: the last 2 chars of one token's text + 2 more.
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    boundary = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = full_text[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    responses = list(
        stub.Generate(pb.GenerateRequest(token_ids=[5, 6], max_tokens=60, stop=[stop]))
    )
    text = "".join(r.text for r in responses)
    assert text == full_text[: full_text.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].stop_reason == stop
    assert len([t for r in responses for t in r.token_ids]) < 60


def test_cancelled_stream_frees_every_block_on_every_worker(
    server: RouterThread, stub: pb_grpc.GenerationStub
) -> None:
    assert _free_blocks(server) == [NUM_BLOCKS] * 3
    call = stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=300), timeout=10)
    first = next(call)
    assert len(first.token_ids) == 1
    next(call)  # a decode token: the decode instance holds blocks now
    assert sum(_free_blocks(server)) < 3 * NUM_BLOCKS
    call.cancel()
    _wait_for_free_blocks(server, [NUM_BLOCKS] * 3)


def test_deadline_ends_the_call_and_frees_the_blocks(
    server: RouterThread, stub: pb_grpc.GenerationStub
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=300), timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for_free_blocks(server, [NUM_BLOCKS] * 3)


def test_worker_overload_is_resource_exhausted(
    server: RouterThread, stub: pb_grpc.GenerationStub
) -> None:
    # Each decode instance has 24 blocks of 16 tokens; 300 + 200 tokens need 32: both refuse.
    with pytest.raises(grpc.RpcError) as error:
        stub.GenerateUnary(pb.GenerateRequest(token_ids=[7] * 300, max_tokens=200), timeout=10)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full" in error.value.details()
    _wait_for_free_blocks(server, [NUM_BLOCKS] * 3)


def test_health_answers_serving(server: RouterThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_client_calls_generate_without_our_stubs(server: RouterThread) -> None:
    client = Client.get_by_endpoint(server.address)
    assert "pdserve.v1.Generation" in client.service_names
    replies = list(
        client.request(
            "pdserve.v1.Generation", "Generate", {"prompt": "hello", "max_tokens": 5}, timeout=10
        )
    )
    assert sum(len(r.get("token_ids", [])) for r in replies) == 5
    assert replies[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_metrics_are_served_with_pdserve_names(server: RouterThread) -> None:
    assert server.router is not None and server.router.metrics_port
    url = f"http://127.0.0.1:{server.router.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in (
        "pdserve:time_to_first_token_seconds_count",
        "pdserve:time_per_output_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_sum",
        "pdserve:e2e_request_latency_seconds_count",
        "pdserve:num_requests_waiting",
        "pdserve:num_requests_running",
        'pdserve:kv_blocks_used{instance="decode-1",role="decode"}',
        'pdserve:request_success_total{finished_reason="length"}',
    ):
        assert name in body, name
    assert 'pdserve:kv_blocks_total{instance="decode-1",role="decode"} 24.0' in body
    assert 'pdserve:request_failure_total{code="RESOURCE_EXHAUSTED"} 1.0' in body
