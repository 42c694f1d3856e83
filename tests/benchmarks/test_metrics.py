"""DistServe's metric math on hand-made timings (binary fractions, so equalities are exact)."""

from __future__ import annotations

import math

import pytest

from planner.metrics import (
    Goodput,
    RequestRecord,
    SLOs,
    attainment,
    breakdown,
    e2e,
    goodput,
    goodput_interval,
    inter_token_latencies,
    latency_stats,
    mean_breakdown,
    percentile,
    tpot,
    ttft,
)


def record(
    send: float, token_times: list[float], error: str = "", **timings: float
) -> RequestRecord:
    return RequestRecord(
        "r",
        prompt_len=8,
        output_len=len(token_times),
        send_time=send,
        token_times=token_times,
        finish_reason="" if error else "length",
        error=error,
        timings=dict(timings),
    )


def test_ttft_tpot_itl_e2e_follow_distserve_definitions() -> None:
    r = record(10.0, [10.5, 10.75, 11.0, 11.5])
    assert ttft(r) == 0.5
    assert tpot(r) == (11.5 - 10.5) / 3
    assert inter_token_latencies(r) == [0.25, 0.25, 0.5]
    assert e2e(r) == 1.5


def test_a_single_token_has_tpot_zero_and_no_gaps() -> None:
    r = record(1.0, [1.25])
    assert tpot(r) == 0.0
    assert inter_token_latencies(r) == []
    assert e2e(r) == ttft(r) == 0.25


def test_tokens_in_one_message_share_a_time_and_count_in_tpot() -> None:
    r = record(0.0, [0.5, 0.5, 1.5])  # the router merged the first two tokens into one message
    assert tpot(r) == 0.5
    assert inter_token_latencies(r) == [0.0, 1.0]


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == 3.0 + 0.7 * 1.0
    assert math.isnan(percentile([], 50))


def test_latency_stats_skip_failed_requests() -> None:
    records = [record(0.0, [0.5, 1.0]), record(0.0, [0.25, 0.75]), record(0.0, [], "UNAVAILABLE")]
    stats = latency_stats(records)
    assert stats["ttft_s"]["p50"] == 0.375
    assert stats["ttft_s"]["mean"] == 0.375
    assert stats["tpot_s"]["p99"] == 0.5
    assert stats["e2e_s"]["p50"] == 0.875


def test_attainment_needs_both_slos_and_scales_them() -> None:
    records = [
        record(0.0, [0.5, 0.75]),  # ttft 0.5, tpot 0.25: meets both at scale 1
        record(0.0, [1.5, 1.75]),  # ttft 1.5: misses TTFT at 1, meets at 2
        record(0.0, [0.5, 1.25]),  # tpot 0.75: misses TPOT at 1 and 2
        record(0.0, [], "DEADLINE_EXCEEDED"),  # failed: a miss at every scale
    ]
    slos = SLOs.single(1.0, 0.25)
    assert attainment(records, slos) == 0.25
    assert attainment(records, slos, scale=2.0) == 0.5
    assert attainment(records, slos, scale=4.0) == 0.75
    assert attainment(records, SLOs.single(0.5, 0.25)) == 0.25  # <= is inclusive
    with pytest.raises(ValueError):
        attainment([], slos)


def test_each_request_is_held_to_its_own_class_slos() -> None:
    slow_first = record(0.0, [1.5, 1.75])  # ttft 1.5, tpot 0.25
    quick = record(0.0, [0.5, 0.55])  # ttft 0.5, tpot 0.05
    slos = SLOs({"summarization": (2.0, 0.1), "chatbot": (1.0, 0.3)})
    slow_first.slo_class, quick.slo_class = "chatbot", "summarization"
    assert attainment([slow_first, quick], slos) == 0.5  # chatbot's TTFT 1.0 s is missed
    slow_first.slo_class = "summarization"  # TTFT 2 s met, TPOT 0.1 s missed
    assert attainment([slow_first, quick], slos) == 0.5
    quick.slo_class = "chatbot"
    assert attainment([quick], slos) == 1.0
    quick.slo_class = "code"
    with pytest.raises(ValueError, match="SLO class 'code'"):
        attainment([quick], slos)
    with pytest.raises(ValueError):
        SLOs({"chatbot": (1.0, 0.0)})


def test_goodput_interpolates_the_first_crossing_of_90_percent() -> None:
    points = [(3.0, 0.75), (1.0, 1.0), (2.0, 0.95), (4.0, 0.95)]  # unsorted; noise at 4.0
    found = goodput(points)  # 2 + (0.95 - 0.9) / (0.95 - 0.75) * (3 - 2)
    assert found.bound == "crossed"
    assert found.rate == pytest.approx(2.25, abs=1e-12)  # 0.9 and 0.95 are not binary fractions


def test_goodput_exactly_at_the_target_counts_as_meeting_it() -> None:
    assert goodput([(1.0, 0.9), (2.0, 0.5)]) == Goodput(1.0, "crossed")


def test_goodput_bounds_when_the_sweep_does_not_cross() -> None:
    assert goodput([(1.0, 1.0), (2.0, 0.9)]) == Goodput(2.0, "at_least")
    assert goodput([(1.0, 0.5), (2.0, 0.25)]) == Goodput(0.0, "below_lowest")
    with pytest.raises(ValueError):
        goodput([])


def test_goodput_interval_holds_the_goodput_and_is_a_point_when_no_draw_can_differ() -> None:
    certain = [(1.0, [True] * 20), (2.0, [False] * 20)]  # every redraw is the same curve
    rate = goodput([(1.0, 1.0), (2.0, 0.0)]).rate  # 1.1, interpolated
    assert goodput_interval(certain) == (rate, rate)
    # 18 of 20 met at rate 2 (exactly 90%): redraws land on both sides of the target
    points = [(1.0, [True] * 20), (2.0, [True] * 18 + [False] * 2), (3.0, [False] * 20)]
    low, high = goodput_interval(points, resamples=400)
    assert low < goodput([(1.0, 1.0), (2.0, 0.9), (3.0, 0.0)]).rate == 2.0 < high
    assert 1.0 <= low and high <= 3.0
    assert goodput_interval(points, resamples=400) == (low, high)  # seeded: reproducible
    with pytest.raises(ValueError):
        goodput_interval(points, confidence=1.0)


def test_breakdown_splits_a_disaggregated_request() -> None:
    r = record(
        0.0,
        [1.0, 1.5, 2.0],
        router_queue_s=0.0625,
        prefill_queue_s=0.25,
        prefill_s=0.5,
        kv_transfer_s=0.125,
        decode_queue_s=0.25,
    )
    assert breakdown(r) == {
        "router_queue": 0.0625,
        "prefill_queue": 0.25,
        "prefill": 0.5,
        "transfer": 0.125,
        "decode_queue": 0.25,
        "decode": 1.0 - 0.125 - 0.25,
    }


def test_breakdown_of_a_colocated_request_has_no_transfer() -> None:
    r = record(0.0, [0.5, 1.0], prefill_queue_s=0.125, prefill_s=0.25)
    parts = breakdown(r)
    assert parts["transfer"] == parts["decode_queue"] == 0.0
    assert parts["decode"] == 0.5
    assert mean_breakdown([r, record(0.0, [], "UNAVAILABLE")])["prefill"] == 0.25
