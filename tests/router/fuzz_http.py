"""Hypothesis strategies for the HTTP API's JSON bodies, and an in-process ASGI call.

A body is a valid request of /v1/completions or /v1/chat/completions (every optional field
drawn or left out) with up to two fields spoiled: left out, or set to a hostile value (text
with lone surrogates, integers far past int32/int64 either way, NaN and infinities, wrong JSON
types, or a value of the right type that the field refuses); or no JSON object at all. Valid
requests ask for few tokens, so the fuzzer stays fast.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import strategies as st
from starlette.types import ASGIApp, Message

SURROGATES = ("\ud800", "\udfff", "\udc00", "\ud83d")
HUGE_INTS = (2**31 - 1, 2**31, -(2**31) - 1, 2**40, -(2**40), 2**63 - 1, 2**63, -(2**63) - 1)
WEIRD_FLOATS = (float("nan"), float("inf"), float("-inf"), 1e308, -1e308, -0.0, 5e-324)

_plain_text = st.text(st.characters(codec="utf-8"), max_size=12)
_surrogate_text = st.builds(
    lambda left, bad, right: left + bad + right,
    _plain_text,
    st.sampled_from(SURROGATES),
    _plain_text,
)
text = st.one_of(_plain_text, _surrogate_text)
wrong_types = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.sampled_from(["", "yes", "1", "true"]),
    st.just([]),
    st.just({}),
    st.just([1, "a"]),
    st.just({"a": 1}),
)
huge_ints = st.sampled_from(HUGE_INTS)
weird_floats = st.sampled_from(WEIRD_FLOATS)


_DROP = object()  # a field left out


def _valid_text(max_size: int = 12) -> st.SearchStrategy[str]:
    return st.text(st.characters(codec="utf-8"), min_size=1, max_size=max_size)


_token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=6)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _valid_text()})
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(_valid_text(), st.lists(_part, min_size=1, max_size=2)),
    }
)
_SAMPLING = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.one_of(st.floats(0, 2), st.integers(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(_valid_text(), st.lists(_valid_text(), max_size=3)),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "frequency_penalty": st.just(0),
    "presence_penalty": st.just(0.0),
    "user": _valid_text(),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
    "request_id": st.text("abcdef0123456789-", min_size=1, max_size=20),
    "ttft_slo_s": st.floats(0.01, 10),
    "tpot_slo_s": st.floats(0.01, 1),
}
# Values of the right type that a field still refuses (unsupported, out of the model's range).
_REFUSED = {
    "prompt": st.sampled_from(["", [], [[1], [2]], [600], [-1], ["a", "b"], "x" * 20_000]),
    "messages": st.sampled_from(
        [[], [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}], [{}]]
    ),
    "max_tokens": st.sampled_from([0, -1, 509, 2**31 - 1]),
    "max_completion_tokens": st.sampled_from([0, -1, 2**31 - 1]),
    "temperature": st.sampled_from([-0.5, 3.0, 1e30]),
    "top_p": st.sampled_from([0.0, 1.5, -1.0]),
    "top_k": st.sampled_from([-1, -(2**31)]),
    "seed": st.sampled_from([-1, -(2**63)]),
    "stop": st.sampled_from(["", [""], ["s"] * 20]),
    "n": st.sampled_from([0, 17, -1]),
    "frequency_penalty": st.sampled_from([2.5, -3.0]),
    "presence_penalty": st.sampled_from([-2.5, 2.1]),
    "logit_bias": st.sampled_from([{"1": 500.0}, {"a": 1.0}, {"a\ud800": float("nan")}]),
    "stop_token_ids": st.sampled_from([[-1], [512], [2**31]]),
    "request_id": st.sampled_from(["", "x" * 200, "a\nb"]),
    "ttft_slo_s": st.sampled_from([0.0, -1.0, 1e-12]),
    "tpot_slo_s": st.sampled_from([0.0, -1.0]),
    "logprobs": st.sampled_from([-1, 21]),
    "best_of": st.sampled_from([0, 2]),
    "suffix": st.just("after"),
    "top_logprobs": st.just(2),
    "tools": st.just([{"type": "function"}]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "\ud800"}]),
}
_hostile = st.one_of(wrong_types, huge_ints, weird_floats, _surrogate_text, text)


def _hostile_for(key: str) -> st.SearchStrategy[Any]:
    refused = _REFUSED.get(key)
    both = _hostile if refused is None else st.one_of(refused, _hostile)
    return st.one_of(both, st.just(_DROP))


def _spoiled(body: dict[str, Any], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """`body` with up to two of its fields (or fields it lacked) set to hostile values."""
    change = st.sampled_from(fields).flatmap(lambda key: st.tuples(st.just(key), _hostile_for(key)))

    def apply(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        spoiled = dict(body)
        for key, value in changes:
            if value is _DROP:
                spoiled.pop(key, None)
            else:
                spoiled[key] = value
        return spoiled

    return st.lists(change, max_size=2).map(apply)


def _bodies(
    model: str, required: dict[str, Any], optional: dict[str, Any]
) -> st.SearchStrategy[Any]:
    valid = st.fixed_dictionaries({"model": st.just(model), **required}, optional=optional)
    fields = sorted({"model", *required, *optional, *_REFUSED})
    return st.one_of(valid.flatmap(lambda body: _spoiled(body, fields)), wrong_types)


def completion_bodies(model: str) -> st.SearchStrategy[Any]:
    prompt = st.one_of(_valid_text(40), st.lists(_valid_text(), min_size=1, max_size=1), _token_ids)
    extras = {"echo": st.just(False), "best_of": st.just(1)}
    return _bodies(model, {"prompt": prompt}, {**_SAMPLING, **extras})


def chat_bodies(model: str) -> st.SearchStrategy[Any]:
    messages = st.lists(_message, min_size=1, max_size=3)
    extras = {
        "max_completion_tokens": st.integers(1, 4),
        "logprobs": st.just(False),
        "response_format": st.just({"type": "text"}),
    }
    return _bodies(model, {"messages": messages}, {**_SAMPLING, **extras})


def encode(body: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity as bare words, lone surrogates as escapes."""
    return json.dumps(body, allow_nan=True).encode()


async def asgi_post(app: ASGIApp, path: str, body: bytes) -> tuple[int, bytes]:
    """One POST through the ASGI app, as uvicorn would make it; (status, whole body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    finished = asyncio.Event()
    request_sent = False
    status = 0
    parts: list[bytes] = []

    async def receive() -> Message:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)  # type: ignore[arg-type]
    finally:
        finished.set()
    return status, b"".join(parts)
