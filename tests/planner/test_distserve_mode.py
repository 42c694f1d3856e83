"""DistServe's simulator's own rules, as the reproduction mode follows them (times in ms)."""

from __future__ import annotations

import random

import numpy as np

from planner.latency import StepModel
from planner.profile import TPProfile
from planner.search import SearchSettings, max_per_gpu_rate
from planner.sim_spec import InstanceSpec, SimOptions
from planner.simulator import Simulator
from planner.workload import distserve_workload

NO_OVERHEAD = (0.0, 0.0)


def _spec(prefill=(10.0, 0.0, 0.0), decode=(5.0, 0.0, 0.0), capacity=None) -> InstanceSpec:
    profile = TPProfile(prefill, decode, decode, overhead=NO_OVERHEAD)
    return InstanceSpec(StepModel(profile), 1, capacity)


def test_decode_step_takes_the_fifo_head_under_the_token_cap() -> None:
    # Three prompts of 10 arrive together; one prefill batch 0 -> 11 (10 + the pp constant 1).
    # Σ(ctx + 1) = 11 each; a cap of 25 lets two step at a time. Steps of 5 ms:
    #   11-16: r0 r1   16-21: r2 r0   21-26: r1 r2     (members rejoin at the tail)
    # DistServe counting: 2 decode steps each. r0 ends at 21, r1 and r2 at 26.
    options = SimOptions(distserve_compat=True, decode_batch_tokens=25)
    result = Simulator(
        [10, 10, 10],
        [2, 2, 2],
        [0.0, 0.0, 0.0],
        prefill=[_spec()],
        decode=[_spec()],
        options=options,
    ).run()
    assert result.ttft_ms.tolist() == [11.0, 11.0, 11.0]
    assert result.tpot_ms.tolist() == [5.0, 7.5, 7.5]


def test_without_the_cap_all_three_step_together() -> None:
    options = SimOptions(distserve_compat=True)
    result = Simulator(
        [10, 10, 10],
        [2, 2, 2],
        [0.0, 0.0, 0.0],
        prefill=[_spec()],
        decode=[_spec()],
        options=options,
    ).run()
    assert result.tpot_ms.tolist() == [5.0, 5.0, 5.0]


def test_fifo_decode_ignores_kv_memory_as_distserve_does() -> None:
    # A KV capacity of 15 tokens would preempt with our decode model; DistServe's has no limit.
    options = SimOptions(distserve_compat=True, decode_batch_tokens=50_000)
    result = Simulator(
        [10, 10],
        [3, 3],
        [0.0, 0.0],
        prefill=[_spec()],
        decode=[_spec(capacity=15)],
        options=options,
    ).run()
    assert result.num_preemptions == 0
    assert result.tpot_ms.tolist() == [5.0, 5.0]


def test_distserve_workload_draws_as_its_simulator_does() -> None:
    # random.seed(seed); random.sample(pairs, n); numpy's legacy gamma(1/cv², cv²/rate) gaps.
    pairs = [(i, 100 + i) for i in range(50)]
    workload = distserve_workload("w", pairs, 5, seed=3)
    random.seed(3)
    drawn = list(zip(workload.prompt_lens, workload.output_lens, strict=True))
    assert drawn == random.sample(pairs, 5)
    np.random.seed(3)
    gaps_ms = np.random.gamma(1.0, 1.0 / 2.0, size=4) * 1000  # at 2 req/s
    expected = np.concatenate(([0.0], np.cumsum(gaps_ms)))
    assert np.allclose(workload.arrivals_ms(2.0), expected)


def test_distserve_bisection_grid() -> None:
    # [0, 5], stop once hi - lo <= 0.25: a threshold of 1.6 ends at 1.5625 (5/2^5 steps).
    settings = SearchSettings(max_per_gpu_rate=5, absolute_eps=0.25, prune=False)
    assert max_per_gpu_rate(lambda rate: rate <= 1.6, 5, settings) == 1.5625
