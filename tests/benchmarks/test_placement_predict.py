"""The prediction of this machine over several profiles: the median, its range, the plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.placement_predict import compare, compare_profiles, write_table_and_plot
from planner.profile import ModelProfile, TPProfile


def _measured_run(folder: Path) -> Path:
    """A `pdserve bench --compare` folder with one regime of 20 requests."""
    (folder / "raw").mkdir(parents=True)
    summary = {"regimes": {"chatbot": {"goodput_disaggregated": 2.0, "goodput_colocated": 4.0}}}
    (folder / "summary.json").write_text(json.dumps(summary))
    requests = [{"prompt_len": 64 + 8 * i, "output_len": 8, "unit_gap_s": 1.0} for i in range(20)]
    slo = {
        "ttft_s": 0.5,
        "tpot_s": 0.05,
        "calibration": {"prompt_len": 200, "prefill_s": 0.1, "decode_step_s": 0.01},
        "start_rate": 2.0,
    }

    # Every request meets its SLOs at the lower rate and none at the higher: the goodput is
    # 10% of the way between them, 2 and 4 as the summary says, whatever the redraw.
    def point(rate: float, met: bool) -> dict[str, object]:
        first = 0.1 if met else 1.0
        record = {
            "request_id": "r",
            "prompt_len": 64,
            "output_len": 3,
            "send_time": 0.0,
            "token_times": [first, first + 0.01, first + 0.02],
        }
        return {"rate_per_device": rate, "records": [record] * 10}

    layouts = {
        "disaggregated": {"points": [point(1.0, True), point(11.0, False)]},
        "colocated": {"points": [point(3.0, True), point(13.0, False)]},
    }
    raw = {"requests": requests, "slo": slo, "config": {}, "layouts": layouts}
    (folder / "raw" / "chatbot.json").write_text(json.dumps(raw))
    return folder


def _profile(speed: float) -> ModelProfile:
    decode = (10.0 / speed, 0.001, 0.5)
    entry = TPProfile(
        (5.0 / speed, 0.5 / speed, 0.0),
        decode,
        decode,
        overhead=(0.0, 0.0),
        serving_path={"path_ttft_ms": 5.0},
    )
    return ModelProfile("m", {1: entry})


def test_several_profiles_give_the_median_and_its_range(tmp_path: Path) -> None:
    folder = _measured_run(tmp_path / "run")
    profiles = [_profile(1.0), _profile(0.5), _profile(2.0)]
    alone = [compare(p, folder) for p in profiles]
    result = compare_profiles(profiles, folder)
    assert result["num_profiles"] == 3
    for index, row in enumerate(result["rows"]):
        each = sorted(run["rows"][index]["predicted"] for run in alone)
        assert each[0] < each[2]  # a slower machine's profile predicts less goodput
        assert row["predicted"] == each[1]
        assert row["predicted_range"] == [each[0], each[2]]
        assert row["measured_interval90"] == [row["measured"]] * 2  # read from the raw records
        assert row["error"] == pytest.approx(each[1] / row["measured"] - 1, abs=1e-3)
    worst = max(abs(row["error"]) for row in result["rows"])
    assert result["cpu_prediction_error"] == pytest.approx(worst, abs=1e-3)
    assert result["cpu_prediction_error_per_profile"] == [r["cpu_prediction_error"] for r in alone]
    plan = result["plans"]["chatbot"]
    assert plan["agree_count"] == sum(run["plans"]["chatbot"]["agrees"] for run in alone)
    assert len(plan["layouts"]) == 3
    table, plot = write_table_and_plot(result, tmp_path)
    assert "median of 3" in table.read_text() and "| 2.00-2.00 |" in table.read_text()
    assert plot.read_bytes()[:4] == b"\x89PNG"
