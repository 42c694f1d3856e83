"""Admission control (bounded queue, RESOURCE_EXHAUSTED at once past it), bearer-token auth on
every call, and TLS, against real routers on 127.0.0.1."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import synthetic_cluster
from tests.router.harness import RouterThread

TOKEN = "s3cret-token"


def test_past_the_queue_bound_requests_get_resource_exhausted_at_once(tiny_model_dir: str) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, max_running_requests=1, max_queued_requests=1)
    make_handles = lambda: synthetic_cluster(1, 0, step_interval_s=0.02)  # noqa: E731
    with RouterThread(config, make_handles) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            running = stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=30), timeout=20)
            next(running)  # dispatched: holds the only running slot
            queued = stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=3), timeout=20)
            time.sleep(0.2)  # let the second request reach the queue
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                stub.GenerateUnary(pb.GenerateRequest(prompt="c", max_tokens=3), timeout=20)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 requests running, 1 queued" in error.value.details()
            assert time.monotonic() - started < 0.5  # refused at once, not after waiting
            # The queued request runs once the first one ends.
            assert sum(len(r.token_ids) for r in running) == 29
            queued_responses = list(queued)
            assert queued_responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert queued_responses[-1].timings.router_queue_s > 0.1


def _self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, cert


@pytest.fixture(scope="module")
def secure_server(
    tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RouterThread, bytes]]:
    key, cert = _self_signed_certificate(tmp_path_factory.mktemp("tls"))
    config = RouterConfig(
        model_dir=tiny_model_dir,
        auth_token=TOKEN,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )
    with RouterThread(config, lambda: synthetic_cluster(1, 0)) as server:
        yield server, cert.read_bytes()


def _secure_channel(server: RouterThread, cert: bytes) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=cert)
    return grpc.secure_channel(server.address, credentials)


def test_bearer_token_is_checked_on_every_call(secure_server: tuple[RouterThread, bytes]) -> None:
    server, cert = secure_server
    with _secure_channel(server, cert) as channel:
        stub = pb_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        request = pb.GenerateRequest(prompt="hi", max_tokens=2)
        calls = [
            lambda md: list(stub.Generate(request, metadata=md, timeout=10)),
            lambda md: stub.GenerateUnary(request, metadata=md, timeout=10),
            lambda md: health.Check(health_pb2.HealthCheckRequest(), metadata=md, timeout=10),
        ]
        for call in calls:
            for metadata in [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]]:
                with pytest.raises(grpc.RpcError) as error:
                    call(metadata)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in error.value.details()
            assert call([("authorization", f"Bearer {TOKEN}")])  # the right token passes


def test_tls_server_refuses_plaintext_clients(secure_server: tuple[RouterThread, bytes]) -> None:
    server, _cert = secure_server
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.GenerateUnary(
                pb.GenerateRequest(prompt="hi", max_tokens=2),
                metadata=[("authorization", f"Bearer {TOKEN}")],
                timeout=3,
            )
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_bearer_scheme_is_case_insensitive_and_the_token_is_not(
    secure_server: tuple[RouterThread, bytes],
) -> None:
    server, cert = secure_server
    with _secure_channel(server, cert) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for scheme in ("bearer", "BEARER", "bEaReR"):
            metadata = [("authorization", f"{scheme} {TOKEN}")]
            assert health.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
        for value in (f"bearer {TOKEN.upper()}", f"Basic {TOKEN}", f"Bearer{TOKEN}"):
            with pytest.raises(grpc.RpcError) as error:
                health.Check(
                    health_pb2.HealthCheckRequest(), metadata=[("authorization", value)], timeout=10
                )
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_unknown_method_is_unauthenticated_before_it_is_unimplemented(
    secure_server: tuple[RouterThread, bytes],
) -> None:
    server, cert = secure_server
    with _secure_channel(server, cert) as channel:
        for method in ("/pdserve.v1.Generation/NoSuchMethod", "/no.such.Service/Call"):
            unary = channel.unary_unary(method)
            streaming = channel.unary_stream(method)
            for metadata, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                ([("authorization", "Bearer wrong")], grpc.StatusCode.UNAUTHENTICATED),
                ([("authorization", f"Bearer {TOKEN}")], grpc.StatusCode.UNIMPLEMENTED),
            ):
                with pytest.raises(grpc.RpcError) as error:
                    unary(b"", metadata=metadata, timeout=10)
                assert error.value.code() == code, (method, metadata)
                with pytest.raises(grpc.RpcError) as error:
                    list(streaming(b"", metadata=metadata, timeout=10))
                assert error.value.code() == code, (method, metadata)
