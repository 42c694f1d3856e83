"""Huge prompts: refused by size before tokenizing, and a long one that is allowed is tokenized
off the event loop, so every other stream keeps flowing meanwhile."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from tests.router.harness import RouterThread

# About a million tokens for the tiny tokenizer: a second or two of tokenizing on 2 cores.
BIG_PROMPT = "The quick brown fox jumps. Le café 我们 🙂 " * 50_000
MAX_MODEL_LEN = 100_000  # allows BIG_PROMPT's characters (x32), not its tokens


def test_a_prompt_over_the_size_bound_is_refused_before_tokenizing(tiny_model_dir: str) -> None:
    config = RouterConfig(model_dir=tiny_model_dir)  # max_model_len 512: 16,384 characters
    with RouterThread(config, lambda: synthetic_cluster(1, 0)) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                stub.GenerateUnary(pb.GenerateRequest(prompt=BIG_PROMPT), timeout=30)
            elapsed = time.monotonic() - started
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt has {len(BIG_PROMPT)} characters, over the limit of 16384" in (
        error.value.details()
    )
    assert elapsed < 1.0  # tokenizing it alone takes longer than that


def test_streams_keep_flowing_while_a_long_prompt_is_tokenized(tiny_model_dir: str) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    make_handles = lambda: synthetic_cluster(1, 0, step_interval_s=0.01)  # noqa: E731
    with RouterThread(config, make_handles) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2000), timeout=60)
            next(stream)
            outcome: list[grpc.RpcError] = []

            def send_big() -> None:
                with pytest.raises(grpc.RpcError) as error:
                    stub.GenerateUnary(pb.GenerateRequest(prompt=BIG_PROMPT), timeout=60)
                outcome.append(error.value)

            sender = threading.Thread(target=send_big)
            sender.start()
            arrivals = []
            while sender.is_alive() and len(arrivals) < 1500:
                next(stream)
                arrivals.append(time.monotonic())
            sender.join(60)
            stream.cancel()
    assert outcome[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the model's maximum length 100000" in outcome[0].details()
    gaps = [later - earlier for earlier, later in zip(arrivals[:-1], arrivals[1:], strict=True)]
    assert len(arrivals) > 20 and max(gaps) < 0.5, max(gaps)
