"""With a bearer token configured, every entry point of a real router on 127.0.0.1 refuses a
missing or wrong token: Generate, GenerateUnary, health and reflection over gRPC (unless the
configuration leaves health or reflection open), every route of the HTTP API, and the metrics
port on a public address. And nothing listens off loopback unless configured."""

from __future__ import annotations

import os
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.cli.client import fetch_metrics
from router.config import RouterConfig, is_loopback_host
from router.synthetic import synthetic_cluster
from tests.listening import is_loopback, listening_addresses
from tests.router.harness import RouterThread
from tests.router.test_admission_auth import _self_signed_certificate

TOKEN = "s3cret-token"
GOOD = [("authorization", f"Bearer {TOKEN}")]
BAD_METADATA = [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]]
BAD_HEADERS = [None, "Bearer wrong", TOKEN, f"Basic {TOKEN}"]
Metadata = list[tuple[str, str]] | None


def _router(tiny_model_dir: str, **options: object) -> RouterThread:
    config = RouterConfig(model_dir=tiny_model_dir, auth_token=TOKEN, **options)
    return RouterThread(config, lambda: synthetic_cluster(1, 0))


def _grpc_calls(channel: grpc.Channel) -> dict[str, Callable[[Metadata], object]]:
    stub = pb_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    request = pb.GenerateRequest(prompt="hi", max_tokens=2)
    return {
        "Generate": lambda md: list(stub.Generate(request, metadata=md, timeout=10)),
        "GenerateUnary": lambda md: stub.GenerateUnary(request, metadata=md, timeout=10),
        "health": lambda md: health.Check(health_pb2.HealthCheckRequest(), metadata=md, timeout=10),
        "reflection": lambda md: _reflected_services(channel, md),
    }


def _reflected_services(channel: grpc.Channel, metadata: Metadata) -> set[str]:
    """The services reflection lists, checked to describe pdserve.v1.Generation too."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Generation"),
    ]
    listed, described = list(
        stub.ServerReflectionInfo(iter(requests), metadata=metadata, timeout=10)
    )
    assert described.file_descriptor_response.file_descriptor_proto  # the .proto, served
    return {service.name for service in listed.list_services_response.service}


def _assert_refused(call: Callable[[Metadata], object], metadata: Metadata) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call(metadata)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in (error.value.details() or "")


def test_every_grpc_entry_point_needs_the_token(tiny_model_dir: str) -> None:
    with _router(tiny_model_dir) as server, grpc.insecure_channel(server.address) as channel:
        calls = _grpc_calls(channel)
        for name, call in calls.items():
            for metadata in BAD_METADATA:
                _assert_refused(call, metadata)
            assert call(GOOD), name
        assert calls["reflection"](GOOD) == {
            "pdserve.v1.Generation",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }


@pytest.mark.parametrize(
    ("options", "open_calls"),
    [
        ({"auth_exempt_health": True}, {"health"}),
        ({"auth_exempt_reflection": True}, {"reflection"}),
        ({"auth_exempt_health": True, "auth_exempt_reflection": True}, {"health", "reflection"}),
    ],
)
def test_health_and_reflection_can_be_left_open_for_probes(
    tiny_model_dir: str, options: dict[str, bool], open_calls: set[str]
) -> None:
    with _router(tiny_model_dir, **options) as server:
        with grpc.insecure_channel(server.address) as channel:
            for name, call in _grpc_calls(channel).items():
                if name in open_calls:
                    assert call(None) and call([("authorization", "Bearer wrong")]), name
                else:
                    _assert_refused(call, None)
                assert call(GOOD), name


def _http_get(url: str, authorization: str | None, context: ssl.SSLContext | None = None) -> int:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=20, context=context) as response:
            assert response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _http_post(url: str, body: bytes, authorization: str | None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("exempt_health", [False, True])
def test_every_http_route_needs_the_token(tiny_model_dir: str, exempt_health: bool) -> None:
    with _router(tiny_model_dir, http_port=0, auth_exempt_health=exempt_health) as server:
        assert server.router is not None
        base = f"http://127.0.0.1:{server.router.http_port}"
        model = server.router.config.model_name
        posts = {
            "/v1/completions": f'{{"model": "{model}", "prompt": "a", "max_tokens": 2}}',
            "/v1/chat/completions": (
                f'{{"model": "{model}", "max_tokens": 2,'
                ' "messages": [{"role": "user", "content": "a"}]}'
            ),
        }
        for path, body in posts.items():
            for header in BAD_HEADERS:
                assert _http_post(base + path, body.encode(), header) == 401, path
            assert _http_post(base + path, body.encode(), f"Bearer {TOKEN}") == 200, path
        for header in BAD_HEADERS:
            assert _http_get(base + "/v1/models", header) == 401
            assert _http_get(base + "/health", header) == (200 if exempt_health else 401)
            # On a loopback http_host /metrics stays open, like a loopback metrics port.
            assert _http_get(base + "/metrics", header) == 200
        for path in ("/v1/models", "/health", "/metrics"):
            assert _http_get(base + path, f"bearer {TOKEN}") == 200, path


def test_public_http_metrics_need_the_token(tiny_model_dir: str) -> None:
    with _router(tiny_model_dir, http_port=0, http_host="0.0.0.0") as server:
        assert server.router is not None
        url = f"http://127.0.0.1:{server.router.http_port}/metrics"
        assert [_http_get(url, header) for header in BAD_HEADERS] == [401] * len(BAD_HEADERS)
        assert _http_get(url, f"Bearer {TOKEN}") == 200


def test_the_metrics_port_needs_the_token_on_a_public_address_only(tiny_model_dir: str) -> None:
    options = {"metrics_port": 0, "metrics_host": "0.0.0.0"}
    with (
        _router(tiny_model_dir, **options) as public,
        _router(tiny_model_dir, metrics_port=0) as local,
    ):
        assert public.router is not None and local.router is not None
        addresses = listening_addresses([os.getpid()])
        assert f"0.0.0.0:{public.router.metrics_port}" in addresses  # as configured
        url = f"http://127.0.0.1:{public.router.metrics_port}/metrics"
        assert [_http_get(url, header) for header in BAD_HEADERS] == [401] * len(BAD_HEADERS)
        assert _http_get(url, f"Bearer {TOKEN}") == 200
        local_url = f"http://127.0.0.1:{local.router.metrics_port}/metrics"
        assert _http_get(local_url, None) == 200  # loopback: open (RouterConfig says why)


def test_public_metrics_take_tls_when_it_is_configured(tiny_model_dir: str, tmp_path: Path) -> None:
    key, cert = _self_signed_certificate(tmp_path)
    options = {"metrics_port": 0, "metrics_host": "0.0.0.0", "tls_cert_file": str(cert)}
    with _router(tiny_model_dir, tls_key_file=str(key), **options) as server:
        assert server.router is not None
        port = server.router.metrics_port
        context = ssl.create_default_context(cafile=str(cert))
        url = f"https://localhost:{port}/metrics"
        assert _http_get(url, None, context) == 401
        assert _http_get(url, f"Bearer {TOKEN}", context) == 200
        with pytest.raises(OSError):  # plain HTTP gets no answer
            _http_get(f"http://127.0.0.1:{port}/metrics", f"Bearer {TOKEN}")
        with socket.create_connection(("127.0.0.1", port)):  # a silent client blocks no one
            assert _http_get(url, f"Bearer {TOKEN}", context) == 200
        # `pdserve status` reads them the same way (--auth-token/--token and --tls-ca)
        text = fetch_metrics(f"localhost:{port}", token=TOKEN, tls_ca=str(cert))
        assert "pdserve:num_requests_running" in text
        with pytest.raises(urllib.error.HTTPError):
            fetch_metrics(f"localhost:{port}", tls_ca=str(cert))


def test_nothing_listens_off_loopback_unless_configured(tiny_model_dir: str) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, metrics_port=0, http_port=0)
    assert all(is_loopback_host(h) for h in (config.host, config.metrics_host, config.http_host))
    with RouterThread(config, lambda: synthetic_cluster(1, 1)) as server:
        router = server.router
        assert router is not None
        addresses = listening_addresses([os.getpid()])
        ports = {int(address.rsplit(":", 1)[1]) for address in addresses}
        assert {router.port, router.metrics_port, router.http_port} <= ports
        assert all(is_loopback(address) for address in addresses), addresses


def test_which_hosts_count_as_loopback() -> None:
    loopback = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"]
    public = ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.1", "example.com", "fe80::1"]
    assert all(is_loopback_host(host) for host in loopback)
    assert not any(is_loopback_host(host) for host in public)


def test_the_open_options_take_booleans_only(tiny_model_dir: str) -> None:
    for name in ("auth_exempt_health", "auth_exempt_reflection"):
        with pytest.raises(ValueError, match=f"{name} must be true or false, got 'yes'"):
            RouterConfig(model_dir=tiny_model_dir, auth_token=TOKEN, **{name: "yes"})
