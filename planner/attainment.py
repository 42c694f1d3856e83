"""Attainment and goodput of a simulated run, by the benchmark's own metric definitions.

`to_records` turns simulated TTFT/TPOT into planner.metrics.RequestRecord, so
`metrics.attainment` judges them exactly as it judges a measured run. The search calls
`joint_attainment`, the same count in numpy (tests/planner check that both agree), or
`separate_ok`, DistServe's simulator criterion: the p-th percentile of TTFT and of TPOT each
under its target.
"""

from __future__ import annotations

import numpy as np

from planner import metrics
from planner.sim_spec import SimResult


def to_records(result: SimResult) -> list[metrics.RequestRecord]:
    """One RequestRecord per simulated request (times in seconds, sent at 0).

    Two token times stand for the run: the first token, and one TPOT later, so metrics.tpot
    gives the simulated TPOT back whatever counting convention the run used.
    """
    records = []
    for index, (ttft, tpot) in enumerate(zip(result.ttft_ms, result.tpot_ms, strict=True)):
        first = float(ttft) / 1000.0
        times = [first, first + float(tpot) / 1000.0] if tpot > 0 else [first]
        records.append(metrics.RequestRecord(f"sim-{index}", 0, len(times), 0.0, times))
    return records


def joint_attainment(result: SimResult, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """metrics.attainment (both SLOs met), computed on arrays."""
    met = (result.ttft_ms <= ttft_slo_ms) & (result.tpot_ms <= tpot_slo_ms)
    return float(np.count_nonzero(met)) / len(met)


def separate_ok(
    result: SimResult, ttft_slo_ms: float, tpot_slo_ms: float, percent: float = 90.0
) -> bool:
    """DistServe's simulator: p-th percentile TTFT < target and p-th percentile TPOT < target."""
    return bool(
        np.percentile(result.ttft_ms, percent) < ttft_slo_ms
        and np.percentile(result.tpot_ms, percent) < tpot_slo_ms
    )
