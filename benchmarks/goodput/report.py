"""From sweep points to the numbers in summary.json (one regime at a time).

Every figure here is recomputable from the raw JSON's per-request timings with metrics.py; the
test (tests/benchmarks/test_goodput_e2e.py) does exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.goodput.placements import placement_breakdown
from benchmarks.goodput.sweep import RatePoint
from planner.metrics import (
    SLOs,
    attainment,
    goodput,
    goodput_interval,
    latency_stats,
    mean_breakdown,
    meets_slo,
    tpot,
    ttft,
)

DEFAULT_SLO_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)


FIXED_LAYOUTS = ("colocated", "disaggregated")


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def adaptive_over_best(goodputs: Mapping[str, float]) -> float | None:
    """The adaptive layout's goodput over the better fixed layout's; None unless all three
    ran (or when neither fixed layout reached 90% at any rate)."""
    if not {"adaptive", *FIXED_LAYOUTS} <= goodputs.keys():
        return None
    return _ratio(goodputs["adaptive"], max(goodputs[name] for name in FIXED_LAYOUTS))


def slos_of(slo: dict[str, Any]) -> SLOs:
    """The SLOs a raw or summary file's `slo` entry holds: one pair, or one per class (a mix)."""
    if "classes" in slo:
        return SLOs({name: (c["ttft_s"], c["tpot_s"]) for name, c in slo["classes"].items()})
    return SLOs.single(slo["ttft_s"], slo["tpot_s"])


def goodput_at_scale(points: Sequence[RatePoint], slos: SLOs, scale: float) -> Any:
    curve = [(p.rate_per_device, attainment(p.records, slos, scale)) for p in points]
    return goodput(curve)


def _point_summary(point: RatePoint, slos: SLOs) -> dict[str, Any]:
    done = [r for r in point.records if r.ok]
    by_class: dict[str, list[Any]] = {}
    for record in point.records:
        by_class.setdefault(record.slo_class, []).append(record)
    return {
        "rate": point.rate,
        "rate_per_device": point.rate_per_device,
        "attainment": attainment(point.records, slos),
        # a mix's classes apart: which of them the point's misses come from
        "attainment_by_class": {
            name: attainment(records, slos) for name, records in by_class.items() if name
        },
        "num_requests": len(point.records),
        "num_failed": len(point.records) - len(done),
        "wall_s": point.wall_s,
        "latency": latency_stats(point.records),
        "breakdown_mean_s": mean_breakdown(point.records),
        "ttft_mean_s": sum(ttft(r) for r in done) / len(done) if done else None,
        "tpot_mean_s": sum(tpot(r) for r in done) / len(done) if done else None,
        "placements": placement_breakdown(point.records),  # None from a fixed layout
    }


def regime_summary(
    points_by_layout: dict[str, list[RatePoint]],
    slos: SLOs,
    slo_scales: Sequence[float] = DEFAULT_SLO_SCALES,
) -> dict[str, Any]:
    """Goodput of each layout (per device, SLO scale 1; `goodputs` holds them all) with its 90%
    bootstrap interval over the requests (metrics.goodput_interval), the disaggregated over
    colocated ratio, adaptive_over_best, and per scale the same; per point: attainment, latency
    percentiles, the mean per-request breakdown and an adaptive layout's placements."""
    result: dict[str, Any] = {"points": {}, "goodput_by_scale": {}}
    for layout, points in points_by_layout.items():
        result["points"][layout] = [_point_summary(p, slos) for p in points]
    for scale in sorted(set(slo_scales) | {1.0}):
        entry: dict[str, Any] = {}
        rates = {}
        for layout, points in points_by_layout.items():
            found = goodput_at_scale(points, slos, scale)
            entry[layout] = {"rate": found.rate, "bound": found.bound}
            rates[layout] = found.rate
        if {"disaggregated", "colocated"} <= set(rates):
            entry["ratio"] = _ratio(rates["disaggregated"], rates["colocated"])
        entry["adaptive_over_best"] = adaptive_over_best(rates)
        result["goodput_by_scale"][f"{scale:g}"] = entry
    main = result["goodput_by_scale"]["1"]
    for layout, points in points_by_layout.items():
        result[f"goodput_{layout}"] = main[layout]["rate"]
        result[f"goodput_{layout}_bound"] = main[layout]["bound"]
        met = [(p.rate_per_device, [meets_slo(r, slos) for r in p.records]) for p in points]
        result[f"goodput_{layout}_interval90"] = list(goodput_interval(met))
    result["goodput_ratio"] = main.get("ratio")
    result["goodputs"] = {layout: main[layout]["rate"] for layout in points_by_layout}
    result["adaptive_over_best"] = main["adaptive_over_best"]
    return result


def common_rate(points_by_layout: dict[str, list[RatePoint]], near: float) -> float | None:
    """The per-device rate that every layout ran, nearest to `near` (for side-by-side plots)."""
    rate_sets = [
        {round(p.rate_per_device, 9) for p in points} for points in points_by_layout.values()
    ]
    shared = set.intersection(*rate_sets) if rate_sets else set()
    return min(shared, key=lambda rate: abs(rate - near)) if shared else None


def point_at(points: Sequence[RatePoint], rate_per_device: float) -> RatePoint:
    return min(points, key=lambda p: abs(p.rate_per_device - rate_per_device))
