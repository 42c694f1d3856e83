"""Arrival processes and synthetic length shapes: seeded, scaled, bounded."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.goodput.workloads import build_requests, random_prompts
from planner.traffic import MIXES, SHAPES, Mix, arrival_offsets, synthetic_lengths, unit_rate_gaps


def test_same_seed_same_arrivals_and_rates_only_compress_time() -> None:
    gaps = unit_rate_gaps(50, "poisson", 1.0, seed=7)
    assert gaps == unit_rate_gaps(50, "poisson", 1.0, seed=7)
    assert gaps != unit_rate_gaps(50, "poisson", 1.0, seed=8)
    slow, fast = arrival_offsets(gaps, 1.0), arrival_offsets(gaps, 4.0)
    assert slow[0] == fast[0] == 0.0
    assert fast == [offset / 4.0 for offset in slow]
    assert slow[-1] == pytest.approx(sum(gaps[1:]))


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 2.0)])
def test_gaps_have_mean_one_and_the_asked_coefficient_of_variation(arrival, cv) -> None:
    gaps = unit_rate_gaps(40_000, arrival, cv, seed=0)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1.0, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.05)


def test_bad_arrival_settings_are_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="arrival must be one of"):
        unit_rate_gaps(3, "uniform", 1.0, 0)
    with pytest.raises(ValueError, match="coefficient of variation"):
        unit_rate_gaps(3, "gamma", 0.0, 0)
    with pytest.raises(ValueError, match="rate must be > 0"):
        arrival_offsets([1.0], 0.0)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_synthetic_lengths_stay_in_range_and_fit_the_model(name) -> None:
    shape = SHAPES[name]
    lengths = synthetic_lengths(shape, 500, max_model_len=600, seed=1)
    assert lengths == synthetic_lengths(shape, 500, max_model_len=600, seed=1)
    for prompt_len, output_len in lengths:
        assert shape.output_range[0] <= output_len <= shape.output_range[1]
        assert 1 <= prompt_len <= shape.prompt_range[1]
        assert prompt_len + output_len <= 600


def test_shapes_differ_the_way_their_datasets_do() -> None:
    def medians(name: str) -> tuple[float, float]:
        lengths = synthetic_lengths(SHAPES[name], 400, 1024, seed=0)
        return statistics.median(p for p, _ in lengths), statistics.median(o for _, o in lengths)

    (chat_in, chat_out), (code_in, _), (sum_in, sum_out) = map(
        medians, ("chatbot", "code", "summarization")
    )
    assert sum_in > chat_in > code_in  # LongBench documents > ShareGPT turns > HumanEval stubs
    assert chat_out > sum_out  # chat answers are long, summaries short


def test_requests_carry_ids_lengths_and_offsets() -> None:
    prompts = random_prompts([(5, 3), (2, 9)], (3, 50), seed=0)
    assert [len(ids) for ids, _ in prompts] == [5, 2]
    assert all(3 <= token < 50 for ids, _ in prompts for token in ids)
    requests = build_requests(prompts, [0.0, 0.5], "x")
    assert [(r.request_id, r.output_len, r.send_offset_s) for r in requests] == [
        ("x-0", 3, 0.0),
        ("x-1", 9, 0.5),
    ]
    with pytest.raises(ValueError, match="2 prompts but 1 arrival"):
        build_requests(prompts, [0.0], "x")


def test_slos_are_calibrated_on_the_long_prompts_of_a_workload() -> None:
    from benchmarks.goodput.compare import slo_base_prompt_len

    # 100 prompts 1..100 tokens: the base is the 90th percentile, not the median, so that
    # prompts longer than the median do not miss the TTFT SLO at every rate.
    assert slo_base_prompt_len(list(range(100, 0, -1))) == 91
    assert slo_base_prompt_len([7]) == 7
    lengths = [n for n, _ in synthetic_lengths(SHAPES["code"], 200, 1024, seed=0)]
    base = slo_base_prompt_len(lengths)
    assert sum(n <= base for n in lengths) >= 0.9 * len(lengths)
    assert base > statistics.median(lengths)


def test_the_mixed_regime_interleaves_all_three_shapes_in_about_equal_shares() -> None:
    classes = MIXES["mixed"].classes(3000, seed=0)
    assert classes == MIXES["mixed"].classes(3000, seed=0)
    assert classes != MIXES["mixed"].classes(3000, seed=1)
    for shape in ("chatbot", "code", "summarization"):
        assert classes.count(shape) == pytest.approx(1000, abs=100)
    assert len({tuple(classes[i : i + 3]) for i in range(0, 60, 3)}) > 3  # not in a fixed cycle
    assert MIXES["mixed"].point_indices(100, 30) == list(range(30))


def test_the_shift_regime_moves_halfway_through_every_point() -> None:
    shift = MIXES["shift"]
    assert shift.classes(6, seed=3) == ["summarization"] * 3 + ["chatbot"] * 3
    # a point of 4 of the 10 requests takes the first 2 of each phase, so it shifts as well
    assert shift.point_indices(10, 4) == [0, 1, 5, 6]
    assert shift.point_indices(10, 5) == [0, 1, 2, 5, 6]
    assert shift.point_indices(10, 10) == list(range(10))
    with pytest.raises(ValueError, match="two or more"):
        Mix("bad", ("chatbot", "poetry"), interleaved=False, source="")


def test_requests_carry_their_slo_class() -> None:
    requests = build_requests([([5], 2), ([6], 3)], [0.0, 0.5], "x", ["code", "chatbot"])
    assert [r.slo_class for r in requests] == ["code", "chatbot"]
    assert [r.slo_class for r in build_requests([([5], 2)], [0.0], "y")] == [""]
    with pytest.raises(ValueError):
        build_requests([([5], 2)], [0.0], "z", ["code", "chatbot"])
