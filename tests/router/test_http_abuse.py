"""The HTTP front door against an adversarial client, on a real router on 127.0.0.1 over synthetic
workers: text no UTF-8 can hold, integers past the protobuf fields' ranges and loosely typed
values get a 400 naming the field; a huge model name is not echoed; bodies past
`http_max_body_bytes` get 413 while they are read, and four 100 MB bodies at once leave the
router's memory where it was; with a token, nothing is routed or read before it is checked; a
client that stops mid-request is disconnected after the read timeouts.

The requests are written by hand (http.client, raw sockets): an SDK would refuse to send most.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from tests.router.harness import RouterThread

TOKEN = "abuse-test-token"
BIG_BODY_BYTES = 100 * 1024 * 1024
MAX_RSS_GROWTH_MB = 100
READ_TIMEOUT_S = 1.0
_SOCKET_TIMEOUT_S = 10.0  # far past every timeout under test: reaching it is the failure


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(
        model_dir=tiny_model_dir,
        http_port=0,
        load_refresh_interval_s=0.05,
        http_header_timeout_s=READ_TIMEOUT_S,
        http_body_timeout_s=READ_TIMEOUT_S,
    )
    make = lambda: synthetic_cluster(1, 1, step_interval_s=0.002)  # noqa: E731
    with RouterThread(config, make) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: str) -> Iterator[RouterThread]:
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, auth_token=TOKEN)
    with RouterThread(config, lambda: synthetic_cluster(1, 1)) as running:
        yield running


def _port(server: RouterThread) -> int:
    assert server.router is not None and server.router.http_port is not None
    return server.router.http_port


def _model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


def _post(
    server: RouterThread, path: str, body: bytes | dict[str, Any], token: str = ""
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # escapes \ud800
    connection = http.client.HTTPConnection("127.0.0.1", _port(server), timeout=20)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _completion(server: RouterThread, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": _model(server), "prompt": "hello", "max_tokens": 2, **fields}
    return _post(server, "/v1/completions", body)


def _chat(server: RouterThread, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": _model(server), "messages": [{"role": "user", "content": "hi"}], **fields}
    return _post(server, "/v1/chat/completions", {"max_tokens": 2, **body})


def _assert_400_naming(answer: tuple[int, dict[str, Any]], field: str) -> None:
    status, body = answer
    assert status == 400, (status, body)
    assert body["error"]["param"] == field, body
    assert body["error"]["message"].startswith(field), body


SURROGATE = "a\ud800b"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": SURROGATE}, "prompt"),
        ({"prompt": [SURROGATE]}, "prompt[0]"),
        ({"stop": SURROGATE}, "stop"),
        ({"stop": ["ok", SURROGATE]}, "stop[1]"),
        ({"request_id": SURROGATE}, "request_id"),
        ({"model": SURROGATE}, "model"),
        ({"user": SURROGATE}, "user"),
    ],
)
def test_a_lone_surrogate_in_a_completion_is_400_naming_the_field(
    server: RouterThread, fields: dict[str, Any], param: str
) -> None:
    _assert_400_naming(_completion(server, **fields), param)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": SURROGATE}], "messages[0].content"),
        ([{"role": SURROGATE, "content": "hi"}], "messages[0].role"),
        (
            [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_in_a_chat_is_400_naming_the_field(
    server: RouterThread, messages: list[dict[str, Any]], param: str
) -> None:
    _assert_400_naming(_chat(server, messages=messages), param)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -(2**40)),
        ("max_tokens", 2**40),
        ("top_k", -(2**40)),
        ("seed", -(2**63) - 1),
        ("seed", 2**63),
        ("stop_token_ids", [2**40]),
        ("max_tokens", True),
        ("stream", "yes"),
        ("ignore_eos", 1),
        ("temperature", "0.5"),
        ("seed", 1.5),
    ],
)
def test_out_of_range_and_loosely_typed_values_are_400_naming_the_field(
    server: RouterThread, field: str, value: Any
) -> None:
    status, body = _completion(server, **{field: value})
    assert status == 400, (status, body)
    assert body["error"]["param"].startswith(field), body


def test_integers_where_floats_go_are_taken(server: RouterThread) -> None:
    status, body = _completion(server, temperature=0, top_p=1)
    assert status == 200, body


def test_a_404_does_not_echo_a_huge_model_name(server: RouterThread) -> None:
    status, body = _completion(server, model="m" * 1_000_000)
    assert status == 404 and body["error"]["param"] == "model", body
    assert len(body["error"]["message"]) < 300, len(body["error"]["message"])
    assert "1000000 characters" in body["error"]["message"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def _send_big_body(port: int, chunked: bool, outcome: list[bytes]) -> None:
    """POST a 100 MB body (declared, or chunked) until the server answers or hangs up."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += (
        b"Transfer-Encoding: chunked\r\n\r\n"
        if chunked
        else b"Content-Length: %d\r\n\r\n" % (BIG_BODY_BYTES)
    )
    piece = b"x" * (1024 * 1024)
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    with socket.create_connection(("127.0.0.1", port), timeout=_SOCKET_TIMEOUT_S) as sock:
        try:
            sock.sendall(head)
            for _ in range(BIG_BODY_BYTES // len(piece)):
                sock.sendall(frame)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed: what it said is in the socket
            pass
        outcome.append(_read_all(sock))


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


@pytest.mark.slow
def test_four_100_mb_bodies_at_once_get_413_and_leave_memory_bounded(
    server: RouterThread,
) -> None:
    port = _port(server)
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], _rss_mb())

    sampler = threading.Thread(target=sample)
    sampler.start()
    outcomes: list[bytes] = []
    senders = [
        threading.Thread(target=_send_big_body, args=(port, chunked, outcomes))
        for chunked in (False, True, False, True)
    ]
    try:
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
    finally:
        done.set()
        sampler.join()
    assert len(outcomes) == 4
    for outcome in outcomes:
        assert outcome.startswith(b"HTTP/1.1 413"), outcome[:200]
        assert b"http_max_body_bytes" in outcome
    growth = peak[0] - before
    assert growth < MAX_RSS_GROWTH_MB, f"RSS grew by {growth:.0f} MB"
    assert _completion(server)[0] == 200  # still serving


def test_a_body_just_under_the_limit_is_read_and_parsed(server: RouterThread) -> None:
    assert server.router is not None
    limit = server.router.config.http_max_body_bytes
    body = json.dumps({"model": _model(server), "prompt": "hi", "max_tokens": 2, "pad": ""})
    padded = body[:-2] + "x" * (limit - len(body)) + '"}'
    assert len(padded) == limit
    assert _post(server, "/v1/completions", padded.encode())[0] == 200
    over = body[:-2] + "x" * (limit - len(body) + 1) + '"}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(over)
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=_SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head)  # refused on the declared length: no body byte is needed
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer, answer[:300]


def test_without_the_token_a_malformed_body_is_401_not_400(guarded: RouterThread) -> None:
    status, body = _post(guarded, "/v1/completions", b"{not json")
    assert status == 401, body
    assert _post(guarded, "/v1/completions", b"{not json", token=TOKEN)[0] == 400


def test_without_the_token_a_body_is_never_read(guarded: RouterThread) -> None:
    """Headers announcing 100 MB and no body byte: the 401 comes at once, not after a read."""
    with socket.create_connection(("127.0.0.1", _port(guarded)), timeout=_SOCKET_TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % BIG_BODY_BYTES
        )
        answer = _read_all(sock)  # the server closes the connection after its answer
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nope"), ("GET", "/v1/models/"), ("GET", "/v1/completions"), ("DELETE", "/health")],
)
def test_without_the_token_unknown_routes_reveal_nothing(
    guarded: RouterThread, method: str, path: str
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", _port(guarded), timeout=20)
    try:
        connection.request(method, path)
        assert connection.getresponse().status == 401
        connection.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert connection.getresponse().status in (404, 405)
    finally:
        connection.close()


def _seconds_until_closed(port: int, *sends: bytes, gap_s: float = 0.0) -> float:
    """Connect, send `sends` (`gap_s` apart), and time how long the server keeps the socket."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=_SOCKET_TIMEOUT_S) as sock:
        try:
            for data in sends:
                sock.sendall(data)
                time.sleep(gap_s)
            while sock.recv(65536):
                pass
        except TimeoutError:
            return _SOCKET_TIMEOUT_S
        except OSError:
            pass
    return time.monotonic() - start


_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"


@pytest.mark.parametrize(
    ("case", "sends", "gap_s"),
    [
        ("nothing sent", (), 0.0),
        ("half a head", (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",), 0.0),
        ("a head trickled", tuple(bytes([b]) for b in _HEAD[:30]), 0.1),
        ("half a body", (_HEAD + b'{"model": "x", ',), 0.0),
    ],
)
def test_a_client_that_stops_mid_request_is_disconnected(
    server: RouterThread, case: str, sends: tuple[bytes, ...], gap_s: float
) -> None:
    held_s = _seconds_until_closed(_port(server), *sends, gap_s=gap_s)
    sending_s = gap_s * len(sends)
    # closed after the timeout (the trickle's head timeout counts from its first byte, in all)
    assert held_s < max(sending_s, READ_TIMEOUT_S) + 2.0, (case, held_s)
    assert _completion(server)[0] == 200


def test_a_slow_body_that_keeps_coming_is_read(server: RouterThread) -> None:
    body = json.dumps({"model": _model(server), "prompt": "hello", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=_SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head)
        for index in range(0, len(body), 20):  # pauses shorter than the body timeout, longer in all
            time.sleep(READ_TIMEOUT_S / 4)
            sock.sendall(body[index : index + 20])
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
