"""A small gRPC client of the router: streaming generation, health, and the metrics page.

    client = RouterClient("127.0.0.1:50051", auth_token=None, tls_ca_file=None)
    for response in client.generate(pb.GenerateRequest(prompt="Hi", max_tokens=8)):
        print(response.text, end="", flush=True)
    client.wait_until_serving(timeout_s=30)
    client.close()

Used by `pdserve generate`, `pdserve status`, `pdserve demo` and benchmarks/cold_start.py; it
speaks only the public API (pdserve_proto stubs and the standard gRPC health service).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


class RouterClient:
    """One channel to a router; every call carries the bearer token when one is given."""

    def __init__(
        self, address: str, auth_token: str | None = None, tls_ca_file: str | None = None
    ) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        # Reconnect quickly: a router that is still starting refuses the first attempts, and
        # gRPC's default backoff (up to 2 minutes) would hide the moment it starts listening.
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 250)]  # fmt: skip
        if tls_ca_file is not None:
            credentials = grpc.ssl_channel_credentials(Path(tls_ca_file).read_bytes())
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._generation = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, request: pb.GenerateRequest, timeout_s: float = 300.0
    ) -> Iterator[pb.GenerateResponse]:
        """The streamed responses of one request, as they arrive (grpc.RpcError on failure)."""
        yield from self._generation.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def health(self, timeout_s: float = 5.0) -> int:
        """The router's overall health status (a HealthCheckResponse.ServingStatus value)."""
        response = self._health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=self._metadata
        )
        return int(response.status)

    def wait_until_serving(self, timeout_s: float, poll_s: float = 0.05) -> float:
        """Poll health until SERVING; returns the seconds waited. TimeoutError past timeout_s."""
        started = time.monotonic()
        last_error = "no answer"
        while time.monotonic() - started < timeout_s:
            try:
                if self.health(timeout_s=1.0) == SERVING:
                    return time.monotonic() - started
                last_error = "NOT_SERVING"
            except grpc.RpcError as exc:
                last_error = exc.code().name
            time.sleep(poll_s)
        raise TimeoutError(f"{self.address} not SERVING within {timeout_s:.0f}s ({last_error})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def fetch_metrics(metrics_address: str, timeout_s: float = 5.0) -> str:
    """The Prometheus text of a router's metrics endpoint (HOST:PORT or a full URL)."""
    url = metrics_address if "://" in metrics_address else f"http://{metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (http only)
        return response.read().decode()
