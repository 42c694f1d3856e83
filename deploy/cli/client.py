"""A client of a running router, from outside: its gRPC API, its health, its metrics page.

    client = RouterClient("127.0.0.1:50051", auth_token=None, tls_ca_file=None)
    for response in client.generate(pb.GenerateRequest(prompt="Hi", max_tokens=8)):
        print(response.text, end="", flush=True)
    client.wait_until_serving(timeout_s=30)
    client.close()
    print(format_status(address, "SERVING", parse_metrics(fetch_metrics("127.0.0.1:9400"))))

Used by `pdserve generate`, `pdserve status`, `pdserve demo` and benchmarks/cold_start.py; it
speaks only the public API (pdserve_proto stubs, the standard gRPC health service, and the
Prometheus page). The router exports every worker's load report there as gauges labelled by
instance and role (router/metrics.py), so `pdserve status` works the same for a Ray cluster and
a local one.
"""

from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

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
        options = [
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 250),
        ]
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


def fetch_metrics(
    metrics_address: str,
    timeout_s: float = 5.0,
    token: str | None = None,
    tls_ca: str | None = None,
) -> str:
    """The Prometheus text of a router's metrics endpoint (HOST:PORT or a full URL). A router
    with a token serves metrics on a public host only to callers with the token, over TLS when
    it has a certificate (`tls_ca` verifies it; the scheme is then https)."""
    scheme = "https" if tls_ca else "http"
    url = metrics_address if "://" in metrics_address else f"{scheme}://{metrics_address}/metrics"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:  # noqa: S310
        return response.read().decode()


_WORKER_GAUGES = {
    "pdserve:worker_num_requests_waiting": "num_waiting",
    "pdserve:worker_num_requests_running": "num_running",
    "pdserve:kv_blocks_used": "num_blocks_used",
    "pdserve:kv_blocks_total": "num_blocks_total",
    "pdserve:worker_healthy": "healthy",
}


@dataclass
class WorkerStatus:
    instance_id: str
    role: str
    num_waiting: int = 0
    num_running: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    healthy: float = 0.0
    node: str = ""  # where it runs (pdserve:worker_node)

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0


@dataclass
class RouterStatus:
    workers: list[WorkerStatus] = field(default_factory=list)
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    failures_by_code: dict[str, int] = field(default_factory=dict)
    kv_links: dict[str, str] = field(default_factory=dict)  # rank pair -> transport


def parse_metrics(text: str) -> RouterStatus:
    """The status in a router's Prometheus text (the names of router/metrics.py)."""
    status = RouterStatus()
    workers: dict[str, WorkerStatus] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name in _WORKER_GAUGES:
                worker = workers.setdefault(
                    labels["instance"], WorkerStatus(labels["instance"], labels["role"])
                )
                attribute = _WORKER_GAUGES[name]
                setattr(worker, attribute, value if attribute == "healthy" else int(value))
            elif name == "pdserve:worker_node" and value >= 1.0:
                workers.setdefault(
                    labels["instance"], WorkerStatus(labels["instance"], labels["role"])
                ).node = labels["node"]
            elif name == "pdserve:kv_link" and value >= 1.0:
                status.kv_links[labels["pair"]] = labels["transport"]
            elif name == "pdserve:num_requests_running":
                status.num_requests_running = int(value)
            elif name == "pdserve:num_requests_waiting":
                status.num_requests_waiting = int(value)
            elif name == "pdserve:request_success_total":
                status.finished_by_reason[labels["finished_reason"]] = int(value)
            elif name == "pdserve:request_failure_total":
                status.failures_by_code[labels["code"]] = int(value)
    status.workers = sorted(workers.values(), key=lambda w: (w.role, w.instance_id))
    return status


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def format_status(address: str, health: str, status: RouterStatus) -> str:
    header = ["instance", "role", "node", "health", "waiting", "running", "KV blocks", "KV used"]
    rows = [
        [
            worker.instance_id,
            worker.role,
            worker.node or "-",
            "healthy" if worker.healthy >= 1.0 else "UNHEALTHY",
            str(worker.num_waiting),
            str(worker.num_running),
            f"{worker.num_blocks_used}/{worker.num_blocks_total}",
            f"{100 * worker.kv_usage:.0f}%",
        ]
        for worker in status.workers
    ]
    finished = sum(status.finished_by_reason.values())
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(status.finished_by_reason.items()))
    failures = sum(status.failures_by_code.values())
    lines = [
        f"router {address}: {health}",
        format_table(header, rows) if rows else "(no worker reported yet)",
        f"requests: {status.num_requests_running} running, {status.num_requests_waiting} "
        f"queued, {finished} finished ({reasons or 'none'}), {failures} failed",
    ]
    if status.kv_links:  # known once a pair has carried a transfer
        links = [[pair, transport] for pair, transport in sorted(status.kv_links.items())]
        lines.append(format_table(["KV link (prefill>decode rank)", "transport"], links))
    return "\n".join(lines)
