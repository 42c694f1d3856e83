"""A short comparison end to end: the two fixed layouts on local clusters (tiny model, 2 rates,
2 client processes; `--layouts` leaves the adaptive one to test_mix_e2e), its JSON checked against
the schemas, and attainment and goodput recomputed from the raw per-request timings equal to
summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from benchmarks.goodput.schema import RAW_SCHEMA, SUMMARY_SCHEMA
from planner.metrics import goodput
from tests.benchmarks.bench_support import run_bench

pytestmark = pytest.mark.slow
TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.05
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    return run_bench(
        tmp_path_factory,
        "summarization",
        "--num-requests",
        str(NUM_REQUESTS),
        "--rates",
        "4,8",
        "--ttft-slo",
        str(TTFT_SLO_S),
        "--tpot-slo",
        str(TPOT_SLO_S),
        "--client-processes",
        "2",
        "--slo-scales",
        "0.5,1,2",
        "--layouts",
        "disaggregated,colocated",
    )


def test_output_matches_the_schemas_and_the_file_on_disk(run) -> None:
    summary, raw, out = run
    jsonschema.validate(summary, SUMMARY_SCHEMA)
    jsonschema.validate(raw, RAW_SCHEMA)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["main_regime"] == "summarization"
    assert summary["slo"]["ttft_s"] == TTFT_SLO_S and summary["slo"]["tpot_s"] == TPOT_SLO_S
    assert set(summary["regimes"]["summarization"]["goodput_by_scale"]) == {"0.5", "1", "2"}


def test_every_request_ran_to_its_target_length_at_every_rate(run) -> None:
    _, raw, _ = run
    targets = [request["output_len"] for request in raw["requests"]]
    assert len(targets) == NUM_REQUESTS
    for layout in ("disaggregated", "colocated"):
        points = raw["layouts"][layout]["points"]
        assert [(p["rate"], p["rate_per_device"]) for p in points] == [(4.0, 2.0), (8.0, 4.0)]
        for point in points:
            records = point["records"]
            assert [r["error"] for r in records] == [""] * NUM_REQUESTS
            assert [len(r["token_times"]) for r in records] == targets  # ignore_eos held
            assert {r["finish_reason"] for r in records} == {"length"}
            assert {r["shard"] for r in records} == {0, 1}  # request i went to shard i % 2
            assert [c["shard"] for c in point["clocks"]] == [0, 1]
            assert len({c["pid"] for c in point["clocks"]}) == 2  # two client processes
            assert all(r["token_times"] == sorted(r["token_times"]) for r in records)
            assert all(r["send_time"] < r["token_times"][0] for r in records)


def _attained(record: dict[str, Any], scale: float) -> bool:
    times = record["token_times"]
    if record["error"] or not times:
        return False
    first_token = times[0] - record["send_time"]
    per_token = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return first_token <= scale * TTFT_SLO_S and per_token <= scale * TPOT_SLO_S


def test_attainment_and_goodput_recomputed_from_raw_timings_equal_the_summary(run) -> None:
    summary, raw, _ = run
    regime = summary["regimes"]["summarization"]
    for scale_key, scale in (("0.5", 0.5), ("1", 1.0), ("2", 2.0)):
        found = {}
        for layout in ("disaggregated", "colocated"):
            curve = []
            for point in raw["layouts"][layout]["points"]:
                records = point["records"]
                share = sum(_attained(r, scale) for r in records) / len(records)
                curve.append((point["rate_per_device"], share))
            if scale == 1.0:
                assert [p["attainment"] for p in regime["points"][layout]] == [a for _, a in curve]
            found[layout] = goodput(curve)
            entry = regime["goodput_by_scale"][scale_key][layout]
            assert (entry["rate"], entry["bound"]) == (found[layout].rate, found[layout].bound)
            if scale == 1.0:  # the bootstrap interval holds the measured figure
                low, high = regime[f"goodput_{layout}_interval90"]
                assert low <= found[layout].rate <= high
        colocated = found["colocated"].rate
        ratio = found["disaggregated"].rate / colocated if colocated > 0 else None
        assert regime["goodput_by_scale"][scale_key]["ratio"] == ratio
    main = regime["goodput_by_scale"]["1"]
    assert summary["goodput_disaggregated"] == main["disaggregated"]["rate"]
    assert summary["goodput_colocated"] == main["colocated"]["rate"]
    assert summary["ratios"] == {"summarization": summary["goodput_ratio"]}


def test_breakdown_shows_a_transfer_only_where_kv_moves(run) -> None:
    summary, _, _ = run
    points = summary["regimes"]["summarization"]["points"]
    assert all(p["breakdown_mean_s"]["transfer"] > 0 for p in points["disaggregated"])
    assert all(p["breakdown_mean_s"]["transfer"] == 0 for p in points["colocated"])
    assert all(p["breakdown_mean_s"]["prefill"] > 0 for ps in points.values() for p in ps)


def test_plots_are_png_files(run) -> None:
    summary, _, out = run
    names = summary["regimes"]["summarization"]["plots"]
    assert sorted(names) == sorted(
        f"summarization_{kind}.png"
        for kind in ("attainment_vs_rate", "attainment_vs_scale", "latency_cdf", "ttft_breakdown")
    )
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
