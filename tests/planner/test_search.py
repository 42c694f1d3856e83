"""The search finds a planted optimum; the bisection finds a planted threshold."""

from __future__ import annotations

import pytest

from planner.profile import ModelProfile, TPProfile
from planner.search import SLO, Cluster, SearchSettings, max_per_gpu_rate, plan
from planner.workload import make_workload


def test_bisection_finds_a_planted_threshold() -> None:
    settings = SearchSettings(eps=0.001)
    found = max_per_gpu_rate(lambda rate: rate <= 3.21, 16.0, settings)
    assert found == pytest.approx(3.21, rel=0.002) and found <= 3.21
    assert max_per_gpu_rate(lambda rate: False, 16.0, settings) == 0.0
    # A floor it cannot reach ends the search at once.
    assert max_per_gpu_rate(lambda rate: rate <= 1.0, 16.0, settings, floor=2.0) == 0.0


def _planted_profile() -> ModelProfile:
    """TP2 prefills 10x faster than TP1 (1 ms/token against 0.1), but decodes in 50 ms steps
    against TP1's 5 ms: the best layout is prefill TP2 + decode TP1."""
    fast, slow = (1.0, 0.1, 0.0), (1.0, 1.0, 0.0)
    return ModelProfile(
        "planted",
        {
            1: TPProfile(slow, (5.0, 0.0, 0.0), (5.0, 0.0, 0.0)),
            2: TPProfile(fast, (50.0, 0.0, 0.0), (50.0, 0.0, 0.0)),
        },
    )


def test_search_finds_the_planted_optimum() -> None:
    workload = make_workload("planted", [(100, 10)] * 10, 300, seed=0)
    slo = SLO(ttft_ms=300.0, tpot_ms=30.0)
    settings = SearchSettings(max_per_gpu_rate=64.0, eps=0.05, pp_choices=(1,))
    result = plan(_planted_profile(), workload, slo, Cluster(1, 3), settings)
    assert result.best.placement.describe() == "prefill tp=2 pp=1 x1, decode tp=1 pp=1 x1"
    assert result.best.placement.layout == "disaggregated"
    # Prefill TP1 alone could not pass 10 req/s (100 ms a prompt) on its 2-GPU pair.
    for scored in result.candidates:
        if scored.placement.prefill is not None and scored.placement.prefill.tp == 1:
            assert scored.per_gpu_rate < 5.0
    assert result.best.per_gpu_rate > 10.0
    assert result.winner_ratio > 1.0
