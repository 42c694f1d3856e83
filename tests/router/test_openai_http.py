"""The OpenAI-compatible HTTP front door, driven with the official `openai` SDK (sync and async,
streamed and whole) against a real router on 127.0.0.1 over synthetic workers (their tokens are
deterministic per prompt, so HTTP and gRPC answers can be compared exactly), plus every error
status. tests/router/test_openai_http_cluster.py runs it over real model workers.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import SyntheticWorker, synthetic_cluster
from router.worker_api import InstanceLoad, Role, TokenEvent, WorkerUnavailable
from tests.router.harness import RouterThread

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def _client(server: RouterThread, api_key: str = "unused") -> openai.OpenAI:
    assert server.router is not None
    base_url = f"http://127.0.0.1:{server.router.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=20)


def _model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05)
    make = lambda: synthetic_cluster(1, 1, step_interval_s=0.002)  # noqa: E731
    with RouterThread(config, make) as running:
        yield running


def _grpc_text(server: RouterThread, **fields: Any) -> pb.GenerateResponse:
    with grpc.insecure_channel(server.address) as channel:
        request = pb.GenerateRequest(temperature=0.0, **fields)
        return pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=20)


def _raw(server: RouterThread, path: str, body: dict | None = None, token: str = "") -> Any:
    """(status, body bytes) of a plain HTTP request, for what the SDK hides."""
    assert server.router is not None
    url = f"http://127.0.0.1:{server.router.http_port}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_sync_sdk_completions_match_grpc_whole_and_streamed(server: RouterThread) -> None:
    client = _client(server)
    expected = _grpc_text(server, prompt="The quick brown fox", max_tokens=12)
    whole = client.completions.create(
        model=_model(server), prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert whole.choices[0].text == expected.text and expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        12,
    )
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + 12
    # Token ids as the prompt, streamed, with usage in a last chunk without choices.
    by_ids = _grpc_text(server, token_ids=[1, 40, 41, 42], max_tokens=9)
    chunks = list(
        client.completions.create(
            model=_model(server),
            prompt=[1, 40, 41, 42],
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_ids.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 9)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stop_string_ends_the_text_with_finish_reason_stop(server: RouterThread) -> None:
    full = _grpc_text(server, prompt="Le café", max_tokens=16).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    result = _client(server).completions.create(
        model=_model(server), prompt="Le café", max_tokens=16, temperature=0, stop=[stop]
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[: full.index(stop)]


def test_async_sdk_chat_matches_grpc_whole_and_streamed(server: RouterThread) -> None:
    expected = _grpc_text(server, messages=[pb.ChatMessage(**m) for m in CHAT], max_tokens=10).text

    async def run() -> tuple[Any, list[Any]]:
        assert server.router is not None
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.router.http_port}/v1",
            api_key="unused",
            max_retries=0,
        ) as client:
            whole = await client.chat.completions.create(
                model=_model(server), messages=CHAT, max_completion_tokens=10, temperature=0
            )
            stream = await client.chat.completions.create(
                model=_model(server),
                messages=CHAT,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.content == expected and expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == expected
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_event_stream_ends_with_done_and_models_health_metrics_answer(
    server: RouterThread,
) -> None:
    body = {"model": _model(server), "prompt": "hi", "max_tokens": 3, "stream": True}
    status, data = _raw(server, "/v1/completions", body)
    assert status == 200
    events = [line for line in data.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    models = _client(server).models.list().data
    assert [m.id for m in models] == [_model(server)]
    assert _raw(server, "/health") == (200, b'{"status":"ok"}')
    status, metrics = _raw(server, "/metrics")
    assert status == 200 and b"pdserve:request_success_total" in metrics


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 600}, "prompt"),  # prompt + max_tokens over the model's 512
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": ["a", ""]}, "prompt"),  # a batch holding an empty prompt
        ({"prompt": [1, 9999]}, "prompt[1]"),
        ({"prompt": ""}, "prompt"),
        ({"stop": ["x", ""]}, "stop[1]"),
        ({"temperature": "warm"}, "temperature"),
        ({"extra_body": {"tpot_slo_s": 0}}, "tpot_slo_s"),  # pdserve's SLO extension
        ({"extra_body": {"ttft_slo_s": -2.5}}, "ttft_slo_s"),
    ],
)
def test_bad_completion_fields_get_400_naming_the_field(
    server: RouterThread, fields: dict, param: str
) -> None:
    body = {"model": _model(server), "prompt": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        _client(server).completions.create(**body)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
        ),
        ({"extra_body": {"guided_regex": "a("}}, "guided_regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        (
            {"extra_body": {"structured_outputs": {"json": {"type": "objekt"}}}},
            "structured_outputs.json",
        ),
        ({"n": 0}, "n"),
    ],
)
def test_bad_chat_fields_get_400_naming_the_field(
    server: RouterThread, fields: dict, param: str
) -> None:
    body = {"model": _model(server), "messages": CHAT, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        _client(server).chat.completions.create(**body)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


def test_an_unknown_model_is_404(server: RouterThread) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _client(server).completions.create(model="gpt-4", prompt="hi")
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "model"


def test_a_model_without_chat_template_gets_a_clear_400(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    del tokenizer_config["chat_template"]
    config_path.write_text(json.dumps(tokenizer_config))
    config = RouterConfig(model_dir=str(model_dir), http_port=0)
    with RouterThread(config, lambda: synthetic_cluster(1, 0)) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            _client(server).chat.completions.create(model="no-template", messages=CHAT)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "messages"
    assert "no chat template" in error["message"]


def test_the_bearer_token_is_the_grpc_one(tiny_model_dir: str) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, auth_token="s3cret")
    with RouterThread(config, lambda: synthetic_cluster(1, 0)) as server:
        with pytest.raises(openai.AuthenticationError) as caught:
            _client(server, api_key="wrong").completions.create(model=_model(server), prompt="a")
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "invalid_api_key"
        completion = {"model": _model(server), "prompt": "a"}
        for path, body in (("/v1/models", None), ("/v1/completions", completion)):
            status, body = _raw(server, path, body)  # no Authorization header at all
            assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        assert _raw(server, "/v1/models", token="s3cret")[0] == 200
        result = _client(server, "s3cret").completions.create(
            model=_model(server), prompt="a", max_tokens=2
        )
        assert result.usage is not None and result.usage.completion_tokens == 2
        with grpc.insecure_channel(server.address) as channel:
            metadata = (("authorization", "Bearer s3cret"),)
            request = pb.GenerateRequest(prompt="a", max_tokens=2)
            reply = pb_grpc.GenerationStub(channel).GenerateUnary(request, metadata=metadata)
            assert reply.usage.completion_tokens == 2


def test_overload_is_429_where_grpc_says_resource_exhausted(tiny_model_dir: str) -> None:
    config = RouterConfig(
        model_dir=tiny_model_dir, http_port=0, max_running_requests=1, max_queued_requests=0
    )
    make = lambda: synthetic_cluster(1, 0, step_interval_s=0.01)  # noqa: E731
    with RouterThread(config, make) as server:
        client = _client(server)
        holder = client.completions.create(
            model=_model(server), prompt="hold", max_tokens=400, stream=True
        )
        next(iter(holder))  # admitted: the one running slot is taken
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=_model(server), prompt="x", stream=stream)
            assert isinstance(caught.value.body, dict)
            assert "capacity" in caught.value.body["message"]
        holder.close()


class _DeadWorker(SyntheticWorker):
    """A worker whose process is gone (once `dead`): every call fails at once."""

    dead = True

    async def load(self, prefix: object = None) -> InstanceLoad:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        return await super().load()

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        return await super().poll_events(timeout_s)


def test_no_healthy_worker_is_503_for_health_and_requests(tiny_model_dir: str) -> None:
    # No waiting for an instance to come back: this one never does.
    config = RouterConfig(
        model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05, recovery_wait_s=0
    )
    make = lambda: ([_DeadWorker("colocated-0", Role.COLOCATED)], [])  # noqa: E731
    with RouterThread(config, make) as server:
        status, body = _raw(server, "/health")
        assert status == 503 and json.loads(body)["error"]["message"]
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                _client(server).completions.create(model=_model(server), prompt="x", stream=stream)
            assert caught.value.status_code == 503
            assert isinstance(caught.value.body, dict)
            assert "no healthy worker" in caught.value.body["message"]


def test_a_worker_lost_mid_stream_ends_the_stream_with_an_error_event(tiny_model_dir: str) -> None:
    worker = _DeadWorker("colocated-0", Role.COLOCATED, step_interval_s=0.01)
    worker.dead = False
    config = RouterConfig(
        model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05, recovery_wait_s=0
    )
    with RouterThread(config, lambda: ([worker], [])) as server:
        body = {"model": _model(server), "prompt": "hi", "max_tokens": 400, "stream": True}
        assert server.router is not None
        url = f"http://127.0.0.1:{server.router.http_port}/v1/completions"
        request = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            assert response.readline().startswith(b"data: {")  # streaming: headers are out
            worker.dead = True
            events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and "colocated-0" in error["message"]


def test_stopping_the_router_ends_an_http_stream_and_frees_its_blocks(
    tiny_model_dir: str,
) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0)
    server = RouterThread(config, lambda: synthetic_cluster(1, 1, step_interval_s=0.01))
    with server:
        stream = _client(server).completions.create(
            model=_model(server), prompt="hi", max_tokens=400, stream=True
        )
        next(iter(stream))
        assert server.router is not None
        server.run(server.router.stop(grace_s=0.2))  # far shorter than the 4 s the stream needs
        with pytest.raises(openai.APIError):
            list(stream)  # cut off: the body ends without [DONE]
        loads = server.loads()
    assert all(load.num_free_blocks == load.num_total_blocks for load in loads)


def test_http_config_is_checked(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="http_port must be an integer"):
        RouterConfig(model_dir=tiny_model_dir, http_port=70000)
    with pytest.raises(ValueError, match="also the gRPC or metrics port"):
        RouterConfig(model_dir=tiny_model_dir, port=8000, http_port=8000)
    with pytest.raises(ValueError, match="served_model_name"):
        RouterConfig(model_dir=tiny_model_dir, served_model_name=" ")
    named = RouterConfig(model_dir=tiny_model_dir, served_model_name="tiny")
    assert named.model_name == "tiny"
    assert RouterConfig(model_dir=tiny_model_dir + "/").model_name == Path(tiny_model_dir).name
