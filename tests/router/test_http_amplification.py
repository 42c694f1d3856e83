"""Bodies within `http_max_body_bytes` whose arrays would cost the router far more than their bytes.

Validating a JSON array costs per item before any check of the request's size runs: a 4 MB body
of 262,000 empty messages, of 1,000,000 one-id prompts, or of 2,000,000 token ids held the event
loop for seconds and grew the router by hundreds of MB. Such arrays are counted on the raw value
first (router/http_api/schemas.py): a batch, too many messages, content parts or stop token ids
get a 400 naming the field before their items are validated, and a prompt of token ids is
validated as token ids only. Through the router's real ASGI app, in-process, over synthetic
workers; the router's memory is sampled around each body.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from router.config import RouterConfig
from router.http_api.schemas import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_TOKEN_IDS
from router.synthetic import synthetic_cluster
from tests.router.fuzz_http import asgi_post
from tests.router.harness import RouterThread

# A body this size of one repeated array item: the most items the body limit lets through.
BODY_BYTES = 4 * 1024 * 1024
# Each refused body may leave the router this much bigger (its bytes, parsed JSON, freed after).
MAX_RSS_GROWTH_MB = 150


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, http_max_body_bytes=BODY_BYTES)
    with RouterThread(config, lambda: synthetic_cluster(1, 1)) as running:
        yield running


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def _filled(head: dict[str, Any], field: str, item: bytes) -> bytes:
    """`head` with `field` an array of `item`, repeated to fill the body limit."""
    start = json.dumps(head)[:-1].encode() + b', "%s": [' % field.encode()
    count = (BODY_BYTES - len(start) - 2) // (len(item) + 1)
    body = start + b",".join([item] * count) + b"]}"
    assert len(body) <= BODY_BYTES
    return body


def _post(server: RouterThread, path: str, body: bytes) -> tuple[int, dict[str, Any], float]:
    """(status, error, MB the router's process grew by at its peak while answering)."""
    assert server.router is not None and server.router.http_app is not None
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        status, answer = server.run(asgi_post(server.router.http_app, path, body), 120)
    finally:
        done.set()
        sampler.join()
    return status, json.loads(answer).get("error", {}), peak[0] - before


def _model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


@pytest.mark.parametrize(
    ("path", "field", "item", "param", "says"),
    [
        ("/v1/chat/completions", "messages", b'{"role":"user"}', "messages", f"{MAX_MESSAGES}"),
        ("/v1/completions", "prompt", b"[1]", "prompt", "batch of"),
        ("/v1/completions", "prompt", b'"a"', "prompt", "batch of"),
        ("/v1/completions", "stop_token_ids", b"1", "stop_token_ids", f"{MAX_STOP_TOKEN_IDS}"),
    ],
)
def test_an_array_filling_the_body_is_refused_before_its_items_are_validated(
    server: RouterThread, path: str, field: str, item: bytes, param: str, says: str
) -> None:
    head: dict[str, Any] = {"model": _model(server), "max_tokens": 2}
    if field != "prompt":
        head["prompt"] = "hi"
    if path == "/v1/chat/completions":
        head.pop("prompt", None)
    status, error, growth_mb = _post(server, path, _filled(head, field, item))
    assert status == 400 and error["param"] == param, error
    assert says in error["message"], error
    assert growth_mb < MAX_RSS_GROWTH_MB, f"the router grew by {growth_mb:.0f} MB"


def test_content_parts_of_all_messages_together_are_counted(server: RouterThread) -> None:
    part = {"type": "text", "text": "a"}
    per_message = MAX_CONTENT_PARTS // 4 + 1
    messages = [{"role": "user", "content": [part] * per_message}] * 4
    body = {"model": _model(server), "messages": messages, "max_tokens": 2}
    status, error, _ = _post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and error["param"] == "messages", error
    assert f"{4 * per_message} content parts" in error["message"], error


def test_a_prompt_of_token_ids_filling_the_body_is_refused_by_length(server: RouterThread) -> None:
    head = {"model": _model(server), "max_tokens": 2}
    status, error, growth_mb = _post(server, "/v1/completions", _filled(head, "prompt", b"1"))
    assert status == 400 and error["param"] == "prompt", error
    assert "over the model's maximum length" in error["message"], error
    assert growth_mb < MAX_RSS_GROWTH_MB, f"the router grew by {growth_mb:.0f} MB"


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": [1, 2, 3]}),
        ("/v1/completions", {"prompt": [[1, 2, 3]]}),
        ("/v1/completions", {"prompt": ["one prompt"]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 32}),
    ],
)
def test_arrays_within_the_caps_are_served(
    server: RouterThread, path: str, fields: dict[str, Any]
) -> None:
    body = {"model": _model(server), "max_tokens": 2, **fields}
    status, error, _ = _post(server, path, json.dumps(body).encode())
    assert status == 200, error
