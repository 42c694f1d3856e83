"""`pdserve status` shows which transport each prefill-decode rank pair's KV runs on, as the
prefill instance reports it in its load, and follows a pair that changes transport."""

from __future__ import annotations

from prometheus_client import generate_latest

from deploy.cli.client import format_status, parse_metrics
from router.metrics import RouterMetrics
from worker.protocol import InstanceLoad, LoadDetails, Role


def _report(metrics: RouterMetrics, links: tuple[tuple[str, str], ...]) -> str:
    details = LoadDetails(node="gpu-node", kv_links=links)
    metrics.observe_load(InstanceLoad("p0", Role.PREFILL, details=details))
    return generate_latest(metrics.registry).decode()


def test_status_lists_each_pairs_transport() -> None:
    metrics = RouterMetrics()
    _report(metrics, (("p0.0>d0.0", "cuda-ipc"), ("p0.0>d1.0", "nccl")))
    text = _report(metrics, (("p0.0>d0.0", "cuda-ipc"), ("p0.0>d1.0", "gloo")))
    status = parse_metrics(text)
    assert status.kv_links == {"p0.0>d0.0": "cuda-ipc", "p0.0>d1.0": "gloo"}  # nccl series gone
    shown = format_status("127.0.0.1:50051", "SERVING", status)
    assert "p0.0>d1.0" in shown and "gloo" in shown and "nccl" not in shown
