"""A hypothesis fuzzer over the HTTP API's JSON bodies (tests/router/fuzz_http.py), through the
real router's ASGI app in-process, over synthetic workers.

Each body gets a 2xx, or a 4xx whose error names a field of the request (`param`); a body that
is no JSON object at all gets a 400 too. Never a 5xx, nor an exception out of the app. After
the run the router is healthy, holds no request, and every worker's KV pool is back to its
start. Derandomized: the same 5,500 cases (3,000 completions, 2,500 chats) every run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from tests.router.fuzz_http import asgi_post, chat_bodies, completion_bodies, encode
from tests.router.harness import RouterThread

_FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)
_REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.05)
    make = lambda: synthetic_cluster(1, 1, step_interval_s=0.0005)  # noqa: E731
    with RouterThread(config, make) as running:
        yield running


def _model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


def _check(server: RouterThread, path: str, body: Any) -> None:
    assert server.router is not None and server.router.http_app is not None
    status, answer = server.run(asgi_post(server.router.http_app, path, encode(body)), _TIMEOUT_S)
    assert 200 <= status < 300 or 400 <= status < 500, (status, body, answer[:300])
    if status >= 300:
        error = json.loads(answer)["error"]
        assert error["message"]
        if status == 404:
            assert error["param"] == "model" and body.get("model") != _model(server)
        elif isinstance(body, dict):
            assert error["param"], (body, error)
            head = error["param"].split("[")[0].split(".")[0]
            assert head in {*body, "model", _REQUIRED[path]}, (body, error)


def _healthy_and_idle(server: RouterThread) -> None:
    router = server.router
    assert router is not None
    deadline = time.monotonic() + 10
    while router.admission.num_running or router.admission.num_waiting:
        assert time.monotonic() < deadline, "requests left running after the fuzz"
        time.sleep(0.05)
    while any(load.num_free_blocks != load.num_total_blocks for load in server.loads()):
        assert time.monotonic() < deadline, "KV blocks left in use after the fuzz"
        time.sleep(0.05)
    assert router.pool.healthy()
    ok = {"model": _model(server), "prompt": "still there", "max_tokens": 2}
    assert router.http_app is not None
    assert server.run(asgi_post(router.http_app, "/v1/completions", encode(ok)))[0] == 200


@pytest.mark.slow
def test_completion_bodies_never_get_a_5xx(server: RouterThread) -> None:
    @settings(_FUZZ, max_examples=1500)
    @given(completion_bodies(_model(server)))
    def one(body: Any) -> None:
        _check(server, "/v1/completions", body)

    one()
    _healthy_and_idle(server)


@pytest.mark.slow
def test_chat_bodies_never_get_a_5xx(server: RouterThread) -> None:
    @settings(_FUZZ, max_examples=1200)
    @given(chat_bodies(_model(server)))
    def one(body: Any) -> None:
        _check(server, "/v1/chat/completions", body)

    one()
    _healthy_and_idle(server)
