"""A regime of mixed shapes end to end (`pdserve bench --compare --workloads shift`, all three
layouts): each shape's SLOs calibrated on its own prompts through the baseline's router, each
request held to its own class's SLOs, attainment recomputed from the raw timings per class equal
to summary.json, and the adaptive layout's placements in the records, the summary and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

from benchmarks.goodput.report import adaptive_over_best
from benchmarks.goodput.schema import RAW_SCHEMA, SUMMARY_SCHEMA
from planner.traffic import SHAPES
from tests.benchmarks.bench_support import run_bench

pytestmark = pytest.mark.slow
NUM_REQUESTS = 8
LAYOUTS = ("colocated", "disaggregated", "adaptive")  # the default --layouts, in run order


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    return run_bench(
        tmp_path_factory,
        "shift",
        "--num-requests",
        str(NUM_REQUESTS),
        "--rates",
        "4",
        "--client-processes",
        "1",
    )


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
    assert (
        classes["summarization"]["calibration"]["prompt_len"]
        > (classes["chatbot"]["calibration"]["prompt_len"])
    )


def test_the_requests_shift_halfway_and_every_record_keeps_its_class(run) -> None:
    _, raw, _ = run
    half = NUM_REQUESTS // 2
    assert [r["slo_class"] for r in raw["requests"]] == ["summarization"] * half + [
        "chatbot"
    ] * half
    assert list(raw["layouts"]) == list(LAYOUTS)
    for layout in LAYOUTS:
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
    for layout in LAYOUTS:
        (point,) = raw["layouts"][layout]["points"]
        (reported,) = regime["points"][layout]
        met = {
            name: [_met(r, classes[name]) for r in point["records"] if r["slo_class"] == name]
            for name in classes
        }
        assert reported["attainment_by_class"] == {
            name: sum(flags) / len(flags) for name, flags in met.items()
        }
        assert reported["attainment"] == sum(map(sum, met.values())) / NUM_REQUESTS


def test_adaptive_over_best_is_the_adaptive_goodput_over_the_better_fixed_one(run) -> None:
    summary, _, _ = run
    regime = summary["regimes"]["shift"]
    assert set(regime["goodputs"]) == set(LAYOUTS) and summary["goodputs"] == regime["goodputs"]
    assert regime["adaptive_over_best"] == adaptive_over_best(regime["goodputs"])
    assert summary["adaptive_over_best"] == {"shift": regime["adaptive_over_best"]}


def test_every_adaptive_request_says_where_and_how_it_was_placed(run) -> None:
    summary, raw, out = run
    (point,) = raw["layouts"]["adaptive"]["points"]
    records = point["records"]
    assert {r["placement_kind"] for r in records} <= {"local", "remote"}
    for r in records:
        assert r["prefill_instance"] in ("adaptive-0", "adaptive-1")
        # a local request decodes where it prefilled; a remote one on the other instance
        same = r["decode_instance"] in ("", r["prefill_instance"])
        assert same == (r["placement_kind"] == "local"), r
        assert r["predicted_ttft_s"] > 0 and r["predicted_tpot_s"] > 0
        assert r["prefill_role_instances"] in (0, 1, 2)
    for layout in ("colocated", "disaggregated"):
        (fixed,) = raw["layouts"][layout]["points"]
        assert {r["placement_kind"] for r in fixed["records"]} == {""}
    regime = summary["regimes"]["shift"]
    (placements,) = [p["placements"] for p in regime["points"]["adaptive"]]
    kinds = [r["placement_kind"] for r in records]
    assert (placements["num_local"], placements["num_remote"], placements["num_unplaced"]) == (
        kinds.count("local"),
        kinds.count("remote"),
        0,
    )
    assert placements["role_changes"][0][0] == 0.0
    assert [p["placements"] for p in regime["points"]["colocated"]] == [None]
    assert "shift_placements.png" in regime["plots"]
    assert (out / "shift_placements.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
