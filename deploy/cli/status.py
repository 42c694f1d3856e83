"""`pdserve status`: workers, load, KV usage and health, read from the router's metrics page.

The router exports every worker's load report as Prometheus gauges labelled by instance and role
(router/metrics.py); this module turns that text into rows and a table. Reading the metrics page
keeps status on the public surface: it works the same for a Ray cluster and a local one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

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
    header = ["instance", "role", "health", "waiting", "running", "KV blocks", "KV used"]
    rows = [
        [
            worker.instance_id,
            worker.role,
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
    return "\n".join(lines)
