"""The rate sweep's policy: which rates it runs, in which order, and how many requests each.

The driver here is a stand-in for the cluster (a system whose requests meet the SLOs exactly
when the offered rate is at most CAPACITY); the sweep itself is the real one.
"""

from __future__ import annotations

import pytest

from benchmarks.goodput.sweep import RateSweep, SweepPolicy, sweep_rates
from benchmarks.goodput.workloads import BenchRequest
from planner.metrics import RequestRecord, SLOs

CAPACITY = 3.0
SLO = SLOs.single(1.0, 0.1)


class CapacityDriver:
    """Answers every request at once; TTFT 0.5 s under CAPACITY, 5 s above it."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, int]] = []  # (rate, number of requests) per run
        self.last_clocks: list[dict] = []

    def run(self, address: str, requests: list[BenchRequest]) -> list[RequestRecord]:
        rate = 1.0 / requests[1].send_offset_s  # unit gaps of 1 s: offsets are i / rate
        self.runs.append((round(rate, 9), len(requests)))
        first_token = 0.5 if rate <= CAPACITY else 5.0
        return [
            RequestRecord(
                r.request_id,
                4,
                2,
                r.send_offset_s,
                [r.send_offset_s + first_token, r.send_offset_s + first_token + 0.05],
                finish_reason="length",
            )
            for r in requests
        ]


def sweep(policy: SweepPolicy, num_requests: int = 30) -> tuple[CapacityDriver, RateSweep]:
    driver = CapacityDriver()
    prompts = [([5, 6, 7], 2)] * num_requests
    gaps = [1.0] * num_requests
    runner = RateSweep(driver, "", prompts, gaps, "t", 2, SLO, policy)  # type: ignore[arg-type]
    runner.run()
    return driver, runner


def test_climbs_until_attainment_collapses_then_refines_the_crossing() -> None:
    driver, runner = sweep(SweepPolicy(start_rate=2.0, growth=1.5, max_points=6))
    assert [rate for rate, _ in driver.runs] == [2.0, 3.0, 4.5, pytest.approx(13.5**0.5)]
    assert [p.rate_per_device for p in runner.points[:3]] == [1.0, 1.5, 2.25]
    driver, _ = sweep(SweepPolicy(start_rate=2.0, growth=1.5, max_points=6, refine=False))
    assert [rate for rate, _ in driver.runs] == [2.0, 3.0, 4.5]


def test_halves_first_when_the_start_rate_already_misses() -> None:
    driver, _ = sweep(SweepPolicy(start_rate=8.0, growth=1.5, max_points=6, max_halvings=2))
    # the crossing it refines is 3 (met) -> 4 (missed), the closest pair
    assert [rate for rate, _ in driver.runs] == [8.0, 4.0, 2.0, 3.0, 4.5, pytest.approx(12**0.5)]
    driver, _ = sweep(SweepPolicy(start_rate=8.0, growth=1.5, max_points=6, max_halvings=1))
    assert [rate for rate, _ in driver.runs] == [8.0, 4.0]  # gives up: goodput below 2/device


def test_climbs_past_max_points_until_a_rate_misses_and_runs_explicit_rates_as_given() -> None:
    driver, _ = sweep(SweepPolicy(start_rate=0.5, growth=2.0, max_points=2))
    assert [rate for rate, _ in driver.runs] == [0.5, 1.0, 2.0, 4.0, pytest.approx(8**0.5)]
    driver, _ = sweep(SweepPolicy(start_rate=0.25, growth=1.5, max_points=2))
    assert [rate for rate, _ in driver.runs] == [0.25, 0.375, 0.5625, 0.84375]  # 2x cap
    driver, _ = sweep(SweepPolicy(start_rate=1.0, rates=(5.0, 1.0)))
    assert [rate for rate, _ in driver.runs] == [5.0, 1.0]


def test_low_rates_send_fewer_requests_but_never_below_the_minimum() -> None:
    policy = SweepPolicy(start_rate=1.0, rates=(0.5, 1.0, 4.0), max_point_s=12.0, min_requests=8)
    driver, _ = sweep(policy, num_requests=30)
    assert driver.runs == [(0.5, 8), (1.0, 12), (4.0, 30)]


def test_a_simulated_sweep_runs_the_rates_the_benchmark_runs() -> None:
    """The predictor (benchmarks/placement_predict.py) runs the sweep's rule on simulated
    attainments: the same rates as a run against the cluster, for the run's own options."""
    policy = SweepPolicy.of_run({"quick": False, "max_points": 6, "rates": []}, start_rate=2.0)
    driver, _ = sweep(policy)
    simulated = sweep_rates(policy, lambda rate: 1.0 if rate <= CAPACITY else 0.0)
    expected = pytest.approx([2.0, 2.8, 3.92, (2.8 * 3.92) ** 0.5])  # 3.92 misses: refine
    assert simulated == expected and [rate for rate, _ in driver.runs] == expected
    quick = SweepPolicy.of_run({"quick": True, "max_points": None}, start_rate=2.0)
    assert (quick.growth, quick.max_points, quick.max_point_s) == (1.6, 4, 15.0)
    assert [quick.num_requests(rate, 100) for rate in (0.5, 2.0, 10.0)] == [20, 30, 100]
