"""The router and KV-transfer benchmark scripts run end to end at a small size and print the JSON
their READMEs promise (the figures themselves are measured by running them, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(*args: str, timeout_s: float = 240.0) -> dict:
    # As the README runs them: `python -m benchmarks.NAME`, the checkout and its stubs on the path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    done = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_router_benchmark_measures_the_router_and_bare_grpc(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    result = run_script(
        "-m",
        "benchmarks.router_load",
        "--clients",
        "4",
        "--tokens",
        "16",
        "--rounds",
        "1",
        "--out",
        str(out),
    )
    assert json.loads(out.read_text()) == result
    for side in ("router", "baseline_bare_grpc"):
        figures = result[side]
        assert figures["tokens_per_s"] > 0
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert result["p99_added_ms"] == result["router"]["p99_ms"]


def test_kv_transfer_benchmark_reports_every_case(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    result = run_script(
        "-m", "benchmarks.kv_transfer_speed", "--quick", "--tokens", "64", "--out", str(out)
    )
    cases = result["cases"]
    # p, d in {1, 2}, two wire modes, five block layouts
    assert len(cases) == 4 * 2 * 5
    layouts = {"contiguous", "prefix-hit", "split-decode", "scattered-source", "scattered"}
    assert {case["blocks"] for case in cases} == layouts
    for case in cases:
        assert case["tokens"] == 64 and case["kv_gbps"] > 0 and case["raw_gbps"] > 0
        # the times are printed to a microsecond, so a ratio recomputed from them carries
        # that rounding on top of the 2%
        rounding = 1e-3 / case["kv_ms"] * (1 + case["raw_ms"] / case["kv_ms"])
        assert case["ratio"] == pytest.approx(
            case["raw_ms"] / case["kv_ms"], rel=0.02, abs=rounding
        )
    assert result["summary"]["default/contiguous"]["max_overhead_ms_at_64"] is not None
    # the transports, worst over p,d: same-node against the network path, and the network path
    # against a raw send per block layout
    assert result["same_node_over_network"]["64"] > 0
    for layout in ("contiguous", "scattered"):
        assert result["network_over_raw_same_run"][layout]["64"] > 0


def test_kv_routing_benchmark_reports_hits_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "kv_routing.json"
    result = run_script(
        "-m",
        "benchmarks.kv_routing",
        "--conversations",
        "4",
        "--turns",
        "2",
        "--system-prompts",
        "2",
        "--system-len",
        "48",
        "--reply-len",
        "4",
        "--concurrency",
        "2",
        "--num-kv-blocks",
        "64",
        "--replicas",
        "2",
        "--model-dir",
        str(tmp_path / "model"),
        "--model-size",
        "tiny",
        "--no-pin",
        "--out",
        str(out),
    )
    assert json.loads(out.read_text()) == result
    assert set(result["hit_rate"]) == {"kv_aware", "least_tokens", "round_robin"}
    for policy, figures in result["policies"].items():
        assert figures["requests"] == 8 and sum(figures["requests_per_instance"].values()) == 8
        assert 0 <= figures["hit_rate"] <= figures["hit_rate_at_most"] < 1, policy
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p90_s"]
    # Every second turn repeats its conversation's history: kv_aware finds some of it.
    assert result["policies"]["kv_aware"]["hit_rate"] > 0
    assert set(result["kv_aware_over_round_robin"]) == {"hit_rate", "ttft_mean", "wall"}
