"""`pdserve bench --target NAME=http://HOST:PORT[:DEVICES]`: the benchmark drives an
OpenAI-compatible server (here pdserve's own HTTP front door, on a real disaggregated cluster)
with the same workload, metrics and plots as a gRPC target, in the same run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.goodput import layouts
from benchmarks.goodput.compare import run_benchmark
from benchmarks.goodput.http_client import fit_arrivals
from benchmarks.goodput.options import parse_bench_args

pytestmark = pytest.mark.slow
NUM_REQUESTS = 6


def test_arrivals_fit_the_token_count_keeping_first_and_last() -> None:
    assert fit_arrivals([1.0, 2.0, 3.0], 3) == [1.0, 2.0, 3.0]
    assert fit_arrivals([1.0, 2.0, 3.0], 5) == [1.0, 2.0, 3.0, 3.0, 3.0]  # a packed last chunk
    assert fit_arrivals([1.0, 2.0, 2.5, 3.0], 3) == [1.0, 2.0, 3.0]
    assert fit_arrivals([1.0], 4) == [1.0] * 4
    assert fit_arrivals([1.0, 2.0], 1) == [1.0]
    assert fit_arrivals([], 3) == []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.ensure_bench_model(tmp_path_factory.mktemp("model"), "tiny")


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[str, int]]:
    """A disaggregated cluster whose router serves gRPC and HTTP: (gRPC address, HTTP port)."""
    spec = layouts.cluster_spec("disaggregated", model_dir, pin_cpus=False)
    spec = dataclasses.replace(spec, router=dataclasses.replace(spec.router, http_port=0))
    cluster = layouts.start_local_cluster(spec)
    try:
        yield cluster.address, cluster.router.http_port
    finally:
        cluster.shutdown()


def test_http_and_grpc_targets_run_the_same_humaneval_load(
    model_dir: Path, served: tuple[str, int], tmp_path: Path
) -> None:
    grpc_address, http_port = served
    args = parse_bench_args(
        [
            "--out",
            str(tmp_path),
            "--model-dir",
            str(model_dir),
            "--model-size",
            "tiny",
            "--workloads",
            "humaneval",
            "--num-requests",
            str(NUM_REQUESTS),
            "--rates",
            "4",
            "--ttft-slo",
            "2",
            "--tpot-slo",
            "0.5",
            "--client-processes",
            "0",
            "--target",
            f"pd-http=http://127.0.0.1:{http_port}:2",
            "--target",
            f"pd-grpc={grpc_address}:2",
        ]
    )
    summary = run_benchmark(args)
    raw = json.loads((tmp_path / "raw" / "humaneval.json").read_text())
    targets = [request["output_len"] for request in raw["requests"]]
    assert raw["workload"]["synthetic"] is False and "HumanEval" in raw["workload"]["source"]
    assert summary["regimes"]["humaneval"]["devices"] == {"pd-http": 2, "pd-grpc": 2}
    for name in ("pd-http", "pd-grpc"):
        (point,) = raw["layouts"][name]["points"]
        records = point["records"]
        assert [r["error"] for r in records] == [""] * NUM_REQUESTS
        assert [len(r["token_times"]) for r in records] == targets  # ignore_eos held
        assert {r["finish_reason"] for r in records} == {"length"}
        assert all(r["send_time"] < r["token_times"][0] for r in records)
    assert set(summary["goodputs"]) == {"pd-http", "pd-grpc"}
    for kind in ("attainment_vs_rate", "attainment_vs_scale", "latency_cdf", "ttft_breakdown"):
        assert (tmp_path / f"humaneval_{kind}.png").read_bytes()[:4] == b"\x89PNG"
