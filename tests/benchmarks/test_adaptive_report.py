"""The adaptive layout's share of the benchmark on hand-made records: adaptive_over_best, the
per-point placement breakdown and its role changes, the per-request SLOs the client sends, and
the placement fields of a record through the raw JSON and back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest
from pdserve_proto.v1 import generation_pb2 as pb

from benchmarks.goodput.client import WallClock, _one_request
from benchmarks.goodput.placements import placement_breakdown, role_changes
from benchmarks.goodput.report import adaptive_over_best, regime_summary
from benchmarks.goodput.schema import POINT_SUMMARY_SCHEMA, RECORD_SCHEMA, REGIME_SCHEMA
from benchmarks.goodput.sweep import RatePoint
from benchmarks.goodput.workloads import BenchRequest, build_requests
from planner.metrics import RequestRecord, SLOs

SLO = SLOs.single(1.0, 0.25)


def placed(send: float, kind: str, roles: int | None, slo_class: str = "") -> RequestRecord:
    """A request that met SLO (TTFT 0.5 s, TPOT 0.25 s), placed `kind` with `roles` instances
    taking remote prefills."""
    return RequestRecord(
        f"r{send}",
        prompt_len=8,
        output_len=2,
        send_time=send,
        token_times=[send + 0.5, send + 0.75],
        finish_reason="length",
        slo_class=slo_class,
        placement_kind=kind,
        prefill_role_instances=roles,
    )


def late(send: float) -> RequestRecord:
    """A request that missed SLO's TTFT (2 s)."""
    return RequestRecord("late", 8, 2, send, [send + 2.0, send + 2.25], finish_reason="length")


def test_adaptive_over_best_divides_by_the_better_fixed_layout() -> None:
    assert adaptive_over_best({"adaptive": 3.0, "colocated": 2.0, "disaggregated": 1.5}) == 1.5
    assert adaptive_over_best({"adaptive": 1.0, "colocated": 1.0, "disaggregated": 4.0}) == 0.25
    assert adaptive_over_best({"adaptive": 3.0, "colocated": 2.0}) is None  # one did not run
    assert adaptive_over_best({"colocated": 2.0, "disaggregated": 1.0}) is None
    assert adaptive_over_best({"adaptive": 1.0, "colocated": 0.0, "disaggregated": 0.0}) is None


def test_role_changes_follow_send_time_and_keep_only_changes() -> None:
    records = [
        placed(12.5, "remote", 1),
        placed(10.0, "local", 0),
        placed(11.0, "local", 0),
        placed(11.5, "local", None),  # no count reported (failed before placement): skipped
        placed(13.0, "remote", 1),
        placed(14.0, "local", 0),
    ]
    assert role_changes(records) == [(0.0, 0), (2.5, 1), (4.0, 0)]
    assert role_changes([]) == []
    assert role_changes([late(1.0)]) == []  # a fixed layout reports none


def test_placement_breakdown_counts_kinds_per_class_and_the_unplaced() -> None:
    records = [
        placed(0.0, "remote", 1, "summarization"),
        placed(1.0, "remote", 1, "summarization"),
        placed(2.0, "local", 1, "summarization"),
        placed(3.0, "local", 0, "chatbot"),
        RequestRecord("failed", 8, 2, 4.0, error="UNAVAILABLE: no instance", slo_class="chatbot"),
    ]
    assert placement_breakdown(records) == {
        "num_local": 2,
        "num_remote": 2,
        "num_unplaced": 1,
        "by_class": {
            "summarization": {"local": 1, "remote": 2},
            "chatbot": {"local": 1, "remote": 0},
        },
        "role_changes": [[0.0, 1], [3.0, 0]],
    }
    assert placement_breakdown([late(0.0), late(1.0)]) is None  # a fixed layout's point


def point(rate: float, records: list[RequestRecord]) -> RatePoint:
    return RatePoint(rate, rate / 2, records, wall_s=1.0)


def test_regime_summary_carries_every_goodput_and_adaptive_over_best() -> None:
    # Per device: colocated meets 90% up to 1 (then 0), disaggregated up to 2, adaptive up to 3.
    met = [placed(float(i), "local", 0) for i in range(4)]
    fixed_met = [placed(float(i), "", None) for i in range(4)]
    missed = [late(float(i)) for i in range(4)]
    points = {
        "colocated": [point(2.0, fixed_met), point(4.0, missed)],
        "disaggregated": [point(2.0, fixed_met), point(4.0, fixed_met), point(6.0, missed)],
        "adaptive": [point(2.0, met), point(4.0, met), point(6.0, met), point(8.0, missed)],
    }
    summary = regime_summary(points, SLO, slo_scales=(1.0, 8.0))
    # each goodput is interpolated at 90% between a point at 100% and one at 0%: low + 0.1
    assert summary["goodputs"] == pytest.approx(
        {"colocated": 1.1, "disaggregated": 2.1, "adaptive": 3.1}
    )
    assert summary["adaptive_over_best"] == pytest.approx(3.1 / 2.1)
    assert summary["goodput_by_scale"]["1"]["adaptive_over_best"] == summary["adaptive_over_best"]
    # at scale 8 every TTFT (2 s) is met: every layout's goodput is its highest rate, at least
    assert summary["goodput_by_scale"]["8"]["adaptive_over_best"] == pytest.approx(4.0 / 3.0)
    assert [p["placements"] for p in summary["points"]["colocated"]] == [None, None]
    adaptive = summary["points"]["adaptive"]
    # the last point's records carry no placement (as if each failed before it): None
    assert [p["placements"] and p["placements"]["num_local"] for p in adaptive] == [4, 4, 4, None]
    assert adaptive[0]["placements"]["role_changes"] == [[0.0, 0]]
    summary.update(
        slo={
            "ttft_s": 1.0,
            "tpot_s": 0.25,
            "start_rate": 1.0,
            "calibration": {"prompt_len": 8, "prefill_s": 0.1, "decode_step_s": 0.01},
        },
        workload={
            "regime": "x",
            "source": "",
            "arrival": "poisson",
            "cv": 1.0,
            "seed": 0,
            "num_requests": 4,
            "mean_prompt_len": 8.0,
            "mean_output_len": 2.0,
        },
        devices={name: 2 for name in points},
        plots=[],
    )
    jsonschema.validate(json.loads(json.dumps(summary)), REGIME_SCHEMA)


def test_without_the_adaptive_layout_there_is_no_adaptive_over_best() -> None:
    met = [placed(float(i), "", None) for i in range(4)]
    summary = regime_summary(
        {"colocated": [point(2.0, met)], "disaggregated": [point(2.0, met)]}, SLO, slo_scales=(1.0,)
    )
    assert summary["adaptive_over_best"] is None
    assert set(summary["goodputs"]) == {"colocated", "disaggregated"}
    for entry in summary["points"]["colocated"]:
        jsonschema.validate(json.loads(json.dumps(entry)), POINT_SUMMARY_SCHEMA)


def test_a_record_keeps_its_placement_through_the_raw_json_and_old_records_still_load() -> None:
    record = placed(1.0, "remote", 1, "chatbot")
    record.prefill_instance, record.decode_instance = "adaptive-0", "adaptive-1"
    record.predicted_ttft_s, record.predicted_tpot_s = 0.375, 0.0625
    data = json.loads(json.dumps(record.to_json()))
    jsonschema.validate(data, RECORD_SCHEMA)
    assert RequestRecord.from_json(data) == record
    # a record of a run made before the placement fields
    old = {
        key: value
        for key, value in data.items()
        if key
        in (
            "request_id",
            "prompt_len",
            "output_len",
            "send_time",
            "token_times",
            "finish_reason",
            "error",
            "timings",
            "shard",
            "slo_class",
        )
    }
    jsonschema.validate(old, RECORD_SCHEMA)
    loaded = RequestRecord.from_json(old)
    assert (loaded.placement_kind, loaded.prefill_role_instances) == ("", None)
    assert loaded.token_times == record.token_times


def test_each_request_carries_its_own_class_slos() -> None:
    slos = SLOs({"summarization": (2.0, 0.1), "chatbot": (1.0, 0.3)})
    prompts = [([3, 4], 2), ([5], 3)]
    requests = build_requests(prompts, [0.0, 0.5], "p", ["chatbot", "summarization"], slos)
    assert [(r.ttft_slo_s, r.tpot_slo_s) for r in requests] == [(1.0, 0.3), (2.0, 0.1)]
    single = build_requests(prompts, [0.0, 0.5], "p", slos=SLO)
    assert [(r.ttft_slo_s, r.tpot_slo_s) for r in single] == [(1.0, 0.25)] * 2
    assert [r.ttft_slo_s for r in build_requests(prompts, [0.0, 0.5], "p")] == [None, None]


class FakeStub:
    """A router's Generate stream: two messages, the last with where and how it ran."""

    def __init__(self, placement: pb.Placement | None) -> None:
        self.placement = placement
        self.sent: list[pb.GenerateRequest] = []

    def Generate(self, message: pb.GenerateRequest, timeout: float) -> Any:  # noqa: N802
        self.sent.append(message)
        last = pb.GenerateResponse(
            token_ids=[7],
            finish_reason=pb.FINISH_REASON_LENGTH,
            prefill_instance="adaptive-0",
            decode_instance="adaptive-1",
        )
        if self.placement is not None:
            last.placement.CopyFrom(self.placement)

        async def stream() -> Any:
            yield pb.GenerateResponse(token_ids=[5])
            yield last

        return stream()


def run_one(stub: FakeStub, request: BenchRequest) -> RequestRecord:
    return asyncio.run(_one_request(stub, request, WallClock(), 0, 10.0))


def test_the_client_sends_the_slos_and_records_the_placement() -> None:
    placement = pb.Placement(
        kind="remote", predicted_ttft_s=0.5, predicted_tpot_s=0.125, prefill_role_instances=1
    )
    stub = FakeStub(placement)
    record = run_one(stub, BenchRequest("a", (3, 4), 2, 0.0, "chatbot", 1.5, 0.25))
    (sent,) = stub.sent
    assert (sent.ttft_slo_s, sent.tpot_slo_s) == (1.5, 0.25)
    assert (record.error, record.finish_reason, len(record.token_times)) == ("", "length", 2)
    assert (record.placement_kind, record.predicted_ttft_s, record.predicted_tpot_s) == (
        "remote",
        0.5,
        0.125,
    )
    assert record.prefill_role_instances == 1
    assert (record.prefill_instance, record.decode_instance) == ("adaptive-0", "adaptive-1")


def test_a_request_without_slos_sends_none_and_a_fixed_layout_reports_no_placement() -> None:
    stub = FakeStub(None)
    record = run_one(stub, BenchRequest("a", (3, 4), 2, 0.0))
    (sent,) = stub.sent
    assert not sent.HasField("ttft_slo_s") and not sent.HasField("tpot_slo_s")
    assert (record.placement_kind, record.prefill_role_instances) == ("", None)
    assert record.prefill_instance == "adaptive-0"  # where it ran is recorded all the same


def test_the_placements_plot_is_drawn_only_for_a_layout_that_placed(tmp_path) -> None:
    from benchmarks.goodput.plots import plot_regime

    shift = [
        placed(0.0, "remote", 1, "summarization"),
        placed(1.0, "remote", 1, "summarization"),
        placed(2.0, "local", 0, "chatbot"),
        placed(3.0, "local", 0, "chatbot"),
    ]
    fixed = [placed(float(i), "", None, r.slo_class) for i, r in enumerate(shift)]
    slos = SLOs({"summarization": (1.0, 0.25), "chatbot": (1.0, 0.25)})
    points = {"colocated": [point(2.0, fixed)], "disaggregated": [point(2.0, fixed)]}
    summary = regime_summary(points, slos, slo_scales=(1.0,))
    names = plot_regime(tmp_path, "shift", points, slos, summary)
    assert "shift_placements.png" not in names
    points["adaptive"] = [point(2.0, shift), point(4.0, shift)]
    summary = regime_summary(points, slos, slo_scales=(1.0,))
    names = plot_regime(tmp_path, "shift", points, slos, summary)
    assert sorted(names) == sorted(
        f"shift_{kind}.png"
        for kind in (
            "attainment_vs_rate",
            "attainment_vs_scale",
            "latency_cdf",
            "ttft_breakdown",
            "placements",
        )
    )
    assert (tmp_path / "shift_placements.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
