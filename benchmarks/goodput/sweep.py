"""The rate sweep of one layout: the same requests at increasing rates until SLOs break.

Rates form one geometric grid, start * growth**k (total requests/s), shared by both layouts so
their points line up. From the start rate the sweep goes up until attainment (at SLO scale 1)
falls below `stop_below`, or `max_points` are run (up to twice as many while every rate still
meets 90%); if even the start rate misses 90%, it first
halves the rate (at most `max_halvings` times) to find a rate that meets it; then it runs one more
rate, the geometric middle of the two around the 90% crossing. An explicit `rates` list runs
exactly those. Each point replays the same prompts with the arrival gaps scaled to its
rate (workloads.arrival_offsets), and the next point starts only when every request has ended.
A point sends the first min(N, max(min_requests, rate * max_point_s)) requests of the workload, so
low rates do not take minutes; every point still draws from the same request sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.goodput.driver import LoadDriver
from benchmarks.goodput.workloads import BenchRequest, build_requests
from planner.metrics import ATTAINMENT_TARGET, RequestRecord, SLOs, attainment
from planner.traffic import arrival_offsets


@dataclass(frozen=True)
class SweepPolicy:
    start_rate: float
    growth: float = 1.4
    max_points: int = 6
    stop_below: float = 0.5
    max_halvings: int = 2
    rates: tuple[float, ...] = ()  # explicit total rates: run these, nothing adaptive
    max_point_s: float = 60.0  # a point sends at most this many seconds of arrivals ...
    min_requests: int = 20  # ... but never fewer requests than this
    refine: bool = True  # one more point between the last rate meeting 90% and the next

    def __post_init__(self) -> None:
        if self.start_rate <= 0 or self.growth <= 1 or self.max_points < 1:
            raise ValueError("need start_rate > 0, growth > 1 and max_points >= 1")
        if any(rate <= 0 for rate in self.rates):
            raise ValueError(f"every rate must be > 0, got {self.rates}")

    @classmethod
    def of_run(cls, config: Mapping[str, Any], start_rate: float) -> SweepPolicy:
        """The sweep of a `pdserve bench` run with options `config` (as raw/*.json keeps them)."""
        quick = bool(config.get("quick"))
        return cls(
            start_rate,
            config.get("growth") or (1.6 if quick else 1.4),
            config.get("max_points") or (4 if quick else 6),
            rates=tuple(config.get("rates") or ()),
            max_halvings=1 if quick else 2,
            max_point_s=15.0 if quick else 60.0,
        )

    def num_requests(self, rate: float, available: int) -> int:
        """How many of the workload's requests a point at `rate` (total) sends."""
        return min(available, max(self.min_requests, int(rate * self.max_point_s)))


@dataclass
class RatePoint:
    rate: float  # offered requests/s, all devices together
    rate_per_device: float
    records: list[RequestRecord]
    wall_s: float  # first send to last token
    clocks: list[dict[str, Any]] = field(default_factory=list)  # per client shard

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "rate_per_device": self.rate_per_device,
            "wall_s": self.wall_s,
            "clocks": self.clocks,
            "records": [record.to_json() for record in self.records],
        }


class RateSweep:
    """Runs the points of one layout against one router address. `classes`: each request's SLO
    class (none: one for all); `pick(available, num)`: which requests a point of `num` sends
    (default the first `num`; a phased mix takes the first of each phase, Mix.point_indices)."""

    def __init__(
        self,
        driver: LoadDriver,
        address: str,
        prompts: list[tuple[list[int], int]],
        unit_gaps: list[float],
        id_prefix: str,
        num_devices: int,
        slos: SLOs,
        policy: SweepPolicy,
        on_point: Callable[[RatePoint, float], None] | None = None,
        classes: Sequence[str] = (),
        pick: Callable[[int, int], list[int]] | None = None,
    ) -> None:
        self.driver = driver
        self.address = address
        self.prompts = prompts
        self.unit_gaps = unit_gaps
        self.id_prefix = id_prefix
        self.num_devices = num_devices
        self.slos = slos
        self.policy = policy
        self.on_point = on_point
        self.classes = list(classes) or [""] * len(prompts)
        self.pick = pick or (lambda available, num: list(range(min(num, available))))
        self.points: list[RatePoint] = []

    def run_rate(self, rate: float) -> RatePoint:
        index = len(self.points)
        chosen = self.pick(len(self.prompts), self.policy.num_requests(rate, len(self.prompts)))
        offsets = arrival_offsets(self.unit_gaps[: len(chosen)], rate)
        requests: list[BenchRequest] = build_requests(
            [self.prompts[i] for i in chosen],
            offsets,
            f"{self.id_prefix}-r{index}",
            [self.classes[i] for i in chosen],
            self.slos,
        )
        records = self.driver.run(self.address, requests)
        finished = [t for r in records for t in r.token_times[-1:]] or [records[0].send_time]
        wall_s = max(finished) - min(r.send_time for r in records)
        point = RatePoint(
            rate, rate / self.num_devices, records, wall_s, list(self.driver.last_clocks)
        )
        self.points.append(point)
        if self.on_point is not None:
            self.on_point(point, self.attainment(point))
        return point

    def attainment(self, point: RatePoint) -> float:
        return attainment(point.records, self.slos)

    def run(self) -> list[RatePoint]:
        sweep_rates(self.policy, lambda rate: self.attainment(self.run_rate(rate)))
        return self.points


def sweep_rates(policy: SweepPolicy, attainment_at: Callable[[float], float]) -> list[float]:
    """The rates a sweep runs, in order, each chosen from the attainments before it:
    `attainment_at(rate)` runs the point (the benchmark's load, or a simulation of it)."""
    steps = sweep_steps(policy)
    rates: list[float] = []
    try:
        rate = next(steps)
        while True:
            rates.append(rate)
            rate = steps.send(attainment_at(rate))
    except StopIteration:
        return rates


def sweep_steps(policy: SweepPolicy) -> Generator[float, float, None]:
    """The sweep as a generator: it yields the next rate to run and takes that point's
    attainment back (`send`), so several sweeps can run side by side, a point of each in turn."""
    done: list[tuple[float, float]] = []  # (total rate, attainment) in the order run
    if policy.rates:
        for rate in policy.rates:
            yield rate
        return
    rate = policy.start_rate
    for _ in range(policy.max_halvings + 1):
        done.append((rate, (yield rate)))
        if done[-1][1] >= ATTAINMENT_TARGET:
            break
        rate /= 2.0
    else:
        return  # even the lowest rate missed 90%: goodput is below it
    while _keep_climbing(policy, done):
        rate *= policy.growth
        done.append((rate, (yield rate)))
        if done[-1][1] < policy.stop_below:
            break
    if policy.refine:  # the geometric middle of the first crossing of 90% (going up in rate),
        ordered = sorted(done)  # so the interpolated goodput rests on two close points
        for (low, att_low), (high, att_high) in zip(ordered, ordered[1:], strict=False):
            if att_low >= ATTAINMENT_TARGET > att_high:
                yield (low * high) ** 0.5
                break


def _keep_climbing(policy: SweepPolicy, done: list[tuple[float, float]]) -> bool:
    """Up to max_points; past them (to twice as many) only while no rate has missed 90% yet,
    so a start rate set too low still ends with a crossing."""
    if len(done) < policy.max_points:
        return True
    crossed = any(att < ATTAINMENT_TARGET for _, att in done)
    return not crossed and len(done) < 2 * policy.max_points


def warm_up(driver: LoadDriver, address: str, prompts: list[tuple[list[int], int]]) -> float:
    """Run the workload's first prompts (4 output tokens each) one by one, then all at once,
    so first-call costs (allocator growth at new batch and prompt sizes, lazy init) stay out of
    the sweep; returns the seconds it took."""
    began = time.monotonic()
    sample = [(ids, 4) for ids, _ in prompts[:8]]
    for index, prompt in enumerate(sample[:2]):
        driver.run(address, build_requests([prompt], [0.0], f"warmup-{index}"))
    driver.run(address, build_requests(sample, [0.0] * len(sample), "warmup-burst"))
    return time.monotonic() - began
