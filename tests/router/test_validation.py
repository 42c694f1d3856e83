"""Every bad request gets INVALID_ARGUMENT with a message saying what to fix; checked over gRPC
against a real router on 127.0.0.1 (the synthetic workers are never reached)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from router.tokenizer import RouterTokenizer
from tests.router.harness import RouterThread


@pytest.fixture(scope="module")
def channel(tiny_model_dir: str) -> Iterator[grpc.Channel]:
    config = RouterConfig(model_dir=tiny_model_dir)
    with RouterThread(config, lambda: synthetic_cluster(1, 0)) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield channel


BAD_REQUESTS = [
    (pb.GenerateRequest(), "the prompt is empty"),
    (pb.GenerateRequest(prompt="hi", token_ids=[5]), "set only one of prompt, token_ids"),
    (
        pb.GenerateRequest(prompt="hi", messages=[pb.ChatMessage(role="user", content="x")]),
        "set only one of prompt, token_ids",
    ),
    (pb.GenerateRequest(token_ids=[5, 512]), "token_ids[1] = 512 is outside the vocabulary"),
    (pb.GenerateRequest(token_ids=[-1]), "token_ids[0] = -1 is outside the vocabulary"),
    (pb.GenerateRequest(token_ids=[5] * 500, max_tokens=13), "over the model's maximum length 512"),
    (pb.GenerateRequest(prompt="hi", max_tokens=0), "max_tokens must be >= 1"),
    (pb.GenerateRequest(prompt="hi", temperature=-0.5), "temperature must be in [0, 100]"),
    (pb.GenerateRequest(prompt="hi", temperature=float("nan")), "temperature must be in"),
    (pb.GenerateRequest(prompt="hi", top_p=0.0), "top_p must be in [1e-06, 1]"),
    (pb.GenerateRequest(prompt="hi", top_p=1.5), "top_p must be in [1e-06, 1]"),
    (pb.GenerateRequest(prompt="hi", top_p=1e-45), "for greedy set temperature 0"),
    (pb.GenerateRequest(prompt="hi", top_p=float("nan")), "top_p must be in [1e-06, 1]"),
    (pb.GenerateRequest(token_ids=[5] * 513), "token_ids has 513 ids, over the model's maximum"),
    (pb.GenerateRequest(prompt="x" * 16385), "the prompt has 16385 characters, over the limit"),
    (
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="y" * 16385)]),
        "the messages have 16385 characters, over the limit of 16384 (32 per token",
    ),
    (pb.GenerateRequest(prompt="hi", top_k=-1), "top_k must be >= 0"),
    (pb.GenerateRequest(prompt="hi", seed=-3), "seed must be >= 0"),
    (pb.GenerateRequest(prompt="hi", stop=["ok", ""]), "stop[1] is empty"),
    (pb.GenerateRequest(prompt="hi", stop=["x"] * 17), "at most 16 stop strings"),
    (pb.GenerateRequest(prompt="hi", stop_token_ids=[600]), "stop_token_ids[0] = 600"),
    (
        pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="x")]),
        "messages[0].role is 'robot'",
    ),
    (  # refused before the template renders them all (on the event loop, for short ones)
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user")] * 100_000),
        "there are 100000 messages, more than the model's maximum length 512",
    ),
    (pb.GenerateRequest(prompt="hi", request_id="x" * 200), "request_id must be at most 128"),
]


@pytest.mark.parametrize("method", ["Generate", "GenerateUnary"])
@pytest.mark.parametrize(("request_message", "expected"), BAD_REQUESTS)
def test_bad_request_is_invalid_argument_with_a_message(
    channel: grpc.Channel, method: str, request_message: pb.GenerateRequest, expected: str
) -> None:
    stub = pb_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        if method == "Generate":
            list(stub.Generate(request_message, timeout=10))
        else:
            stub.GenerateUnary(request_message, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.value.details()


def _raw_request(field_number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand (payload shorter than 128 bytes)."""
    assert len(payload) < 128
    return bytes([field_number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (_raw_request(1, b"caf\xc3"), "prompt (byte 3) is not valid UTF-8"),
        (_raw_request(1, b"\xff\xfe hello"), "prompt (byte 0) is not valid UTF-8"),
        (
            _raw_request(3, _raw_request(1, b"user") + _raw_request(2, b"ok \xed\xa0\x80")),
            "messages[0].content (byte 3) is not valid UTF-8",
        ),
        (_raw_request(1, b"ok") + _raw_request(9, b"\xc0\xaf"), "stop[0] (byte 0) is not valid"),
        (b"\x0a\x09abc", "not a well-formed pdserve.v1.GenerateRequest"),
    ],
)
def test_malformed_utf8_from_a_raw_client_is_invalid_argument(
    channel: grpc.Channel, raw: bytes, expected: str
) -> None:
    # Our stubs cannot even build such a message; a raw channel call sends the bytes as they are.
    for method, call in (
        ("Generate", channel.unary_stream),
        ("GenerateUnary", channel.unary_unary),
    ):
        rpc = call(f"/pdserve.v1.Generation/{method}")
        with pytest.raises(grpc.RpcError) as error:
            result = rpc(raw, timeout=10)
            if method == "Generate":
                list(result)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in error.value.details()


def test_a_valid_request_on_the_same_server_succeeds(
    channel: grpc.Channel, tokenizer: RouterTokenizer
) -> None:
    stub = pb_grpc.GenerationStub(channel)
    messages = [
        pb.ChatMessage(role="system", content="be brief"),
        pb.ChatMessage(role="user", content="hi"),
    ]
    reply = stub.GenerateUnary(pb.GenerateRequest(messages=messages, max_tokens=3), timeout=10)
    assert len(reply.token_ids) == 3 and reply.finish_reason == pb.FINISH_REASON_LENGTH
    # The chat template rendered both turns and the assistant's prompt.
    chat = [("system", "be brief"), ("user", "hi")]
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(chat)) > 10
