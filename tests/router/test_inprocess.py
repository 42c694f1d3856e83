"""The router in front of a real tiny model: `engine.LLMEngine` in-process behind
a colocated Worker in the router's process behind a LocalHandle, served over gRPC on
127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.handle import LocalHandle
from engine.config import EngineConfig
from router.config import RouterConfig
from router.tokenizer import RouterTokenizer
from tests.router.harness import RouterThread
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

NUM_KV_BLOCKS = 48


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    engine_config = EngineConfig(
        model_dir=tiny_model_dir, num_kv_blocks=NUM_KV_BLOCKS, num_threads=1
    )
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.02)

    def make_handles():
        worker = Worker(WorkerConfig(engine_config), "colocated-0")
        return [LocalHandle("colocated-0", Role.COLOCATED, worker)], []

    with RouterThread(config, make_handles) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: RouterThread) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_streamed_text_equals_unary_text_and_decoding_the_ids(
    stub: pb_grpc.GenerationStub, tokenizer: RouterTokenizer
) -> None:
    request = pb.GenerateRequest(prompt="Le café 我们 🙂", max_tokens=24, ignore_eos=True)
    responses = list(stub.Generate(request, timeout=30))
    token_ids = [t for r in responses for t in r.token_ids]
    assert len(token_ids) == 24 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    unary = stub.GenerateUnary(request, timeout=30)
    assert list(unary.token_ids) == token_ids  # greedy: the same tokens both ways
    assert unary.text == "".join(r.text for r in responses) == tokenizer.decode(token_ids)
    assert unary.usage.prompt_tokens == len(tokenizer.encode("Le café 我们 🙂"))
    assert unary.timings.prefill_s > 0 and unary.timings.first_token_s > 0


def test_stop_string_cuts_real_model_output_exactly(stub: pb_grpc.GenerationStub) -> None:
    base = pb.GenerateRequest(token_ids=[1, 40, 41, 42], max_tokens=24, ignore_eos=True)
    full_text = stub.GenerateUnary(base, timeout=30).text
    stop = full_text[5:8]
    assert len(stop) == 3
    request = pb.GenerateRequest()
    request.CopyFrom(base)
    request.stop.append(stop)
    responses = list(stub.Generate(request, timeout=30))
    assert "".join(r.text for r in responses) == full_text[: full_text.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].stop_reason == stop


def test_concurrent_streams_each_get_their_own_tokens(stub: pb_grpc.GenerationStub) -> None:
    prompts = ["hello", "Le café", "今天天气", "🙂🚀"]
    expected = {
        p: list(
            stub.GenerateUnary(
                pb.GenerateRequest(prompt=p, max_tokens=12, ignore_eos=True)
            ).token_ids
        )
        for p in prompts
    }
    results: dict[str, list[int]] = {}

    def stream(prompt: str) -> None:
        call = stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=12, ignore_eos=True), timeout=30
        )
        results[prompt] = [t for r in call for t in r.token_ids]

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == expected


def test_cancelled_stream_frees_every_kv_block(
    server: RouterThread, stub: pb_grpc.GenerationStub
) -> None:
    assert [load.num_free_blocks for load in server.loads()] == [NUM_KV_BLOCKS]
    call = stub.Generate(
        pb.GenerateRequest(token_ids=list(range(3, 100)), max_tokens=300, ignore_eos=True),
        timeout=30,
    )
    for _ in range(3):
        next(call)
    assert server.loads()[0].num_free_blocks < NUM_KV_BLOCKS
    call.cancel()
    deadline = time.monotonic() + 10
    while server.loads()[0].num_free_blocks != NUM_KV_BLOCKS and time.monotonic() < deadline:
        time.sleep(0.02)
    load = server.loads()[0]
    assert (load.num_free_blocks, load.num_running, load.num_waiting_requests) == (
        NUM_KV_BLOCKS,
        0,
        0,
    )


def test_a_vanishing_temperature_is_greedy(stub: pb_grpc.GenerationStub) -> None:
    # 1e-45 is 0 in float32: dividing the logits by it made every token id 0.
    base = pb.GenerateRequest(token_ids=[1, 40, 41, 42], max_tokens=8, ignore_eos=True)
    greedy = list(stub.GenerateUnary(base, timeout=30).token_ids)
    for temperature in (1e-45, 1e-7):
        request = pb.GenerateRequest()
        request.CopyFrom(base)
        request.temperature = temperature
        assert list(stub.GenerateUnary(request, timeout=30).token_ids) == greedy
    assert greedy != [0] * 8
