"""A regime of mixed shapes end to end (`pdserve bench --compare --workloads shift`): each shape's
SLOs calibrated on its own prompts through the baseline's router, each request held to its own
class's SLOs, and attainment recomputed from the raw timings per class equal to summary.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

from benchmarks.goodput.schema import RAW_SCHEMA, SUMMARY_SCHEMA
from planner.traffic import SHAPES
from tests.benchmarks.bench_support import run_bench

pytestmark = pytest.mark.slow
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    return run_bench(tmp_path_factory, "shift", "--num-requests", str(NUM_REQUESTS), "--rates",
                     "4", "--client-processes", "1")  # fmt: skip


def test_each_shape_gets_slos_from_its_own_prompts(run) -> None:
    summary, raw, _ = run
    jsonschema.validate(summary, SUMMARY_SCHEMA)
    jsonschema.validate(raw, RAW_SCHEMA)
    classes = raw["slo"]["classes"]
    assert set(classes) == {"summarization", "chatbot"}
    for name, slo in classes.items():
        shape, base = SHAPES[name], slo["calibration"]
        assert slo["ttft_s"] == pytest.approx(shape.ttft_slo_factor * base["prefill_s"])
        assert slo["tpot_s"] == pytest.approx(shape.tpot_slo_factor * base["decode_step_s"])
        lens = [r["prompt_len"] for r in raw["requests"] if r["slo_class"] == name]
        assert min(lens) <= base["prompt_len"] <= max(lens)  # its own prompts' 90th percentile
    assert classes["summarization"]["calibration"]["prompt_len"] > (
        classes["chatbot"]["calibration"]["prompt_len"]
    )


def test_the_requests_shift_halfway_and_every_record_keeps_its_class(run) -> None:
    _, raw, _ = run
    half = NUM_REQUESTS // 2
    assert [r["slo_class"] for r in raw["requests"]] == ["summarization"] * half + ["chatbot"] * half
    for layout in ("disaggregated", "colocated"):
        (point,) = raw["layouts"][layout]["points"]
        assert [r["slo_class"] for r in point["records"]] == [
            r["slo_class"] for r in raw["requests"]
        ]
        assert [r["error"] for r in point["records"]] == [""] * NUM_REQUESTS


def _met(record: dict[str, Any], slo: dict[str, float]) -> bool:
    times = record["token_times"]
    if record["error"] or not times:
        return False
    per_token = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - record["send_time"] <= slo["ttft_s"] and per_token <= slo["tpot_s"]


def test_attainment_recomputed_per_class_equals_the_summary(run) -> None:
    summary, raw, _ = run
    classes = raw["slo"]["classes"]
    regime = summary["regimes"]["shift"]
    for layout in ("disaggregated", "colocated"):
        (point,) = raw["layouts"][layout]["points"]
        (reported,) = regime["points"][layout]
        met = {name: [_met(r, classes[name]) for r in point["records"] if r["slo_class"] == name]
               for name in classes}  # fmt: skip
        assert reported["attainment_by_class"] == {
            name: sum(flags) / len(flags) for name, flags in met.items()
        }
        assert reported["attainment"] == sum(map(sum, met.values())) / NUM_REQUESTS
