"""The serving path's terms: per-sequence step cost, the TTFT path, the relay's share of the
cores, and their round trip through a profile file (times in ms)."""

from __future__ import annotations

import pytest

from planner.latency import StepModel
from planner.profile import ModelProfile, TPProfile, load_profile, save_profiles
from planner.serving_path import apply_serving_path, relay_ms, relay_scale, ttft_path_ms
from planner.sim_spec import InstanceSpec, SimOptions
from planner.simulator import Simulator

PATH = {"worker_step_ms": 1.0, "worker_step_wall_ms": 2.0, "worker_seq_ms": 0.5,
        "relay_request_ms": 1.0, "relay_token_ms": 0.5, "path_ttft_ms": 7.0}  # fmt: skip


def _profile() -> ModelProfile:
    entry = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0),
                      serving_path=PATH)  # fmt: skip
    return ModelProfile("m", {1: entry})


def test_relay_share_of_the_cores() -> None:
    # 10 req/s x (1 + 50 x 0.5) ms = 0.26 cores over 2 cores: each step takes 1 / (1 - 0.13).
    assert relay_scale((1.0, 0.5), 10.0, 50.0, 2) == pytest.approx(1 / 0.87)
    assert relay_scale((0.0, 0.0), 10.0, 50.0, 2) == 1.0


def test_terms_reach_the_timeline() -> None:
    # Step cost: the larger of CPU (1) and wall (2) per step, + 0.5 per sequence. Two prompts
    # prefill in one batch: (10 + 1) + 2 + 2 x 0.5 = 14, doubled by step_scale 2 -> 28, plus
    # the 7 ms TTFT path. Then one decode step of both: (5 + 2 + 1) x 2 = 16.
    profile = apply_serving_path(_profile())
    spec = InstanceSpec(StepModel(profile.tp(1)), 1, None)
    options = SimOptions(ttft_path_ms=ttft_path_ms(profile), step_scale=2.0)
    result = Simulator([10, 10], [2, 2], [0.0, 0.0], prefill=[spec], decode=[spec],
                       options=options).run()  # fmt: skip
    assert result.ttft_ms.tolist() == [35.0, 35.0]
    assert result.tpot_ms.tolist() == [16.0, 16.0]


def test_serving_path_round_trips_through_the_file(tmp_path) -> None:
    path = tmp_path / "p.json"
    save_profiles(path, {"m": apply_serving_path(_profile())})
    loaded = load_profile(path)
    assert loaded.tp(1).serving_path == PATH
    assert loaded.tp(1).overhead_per_seq == 0.5
    assert relay_ms(loaded) == (1.0, 0.5)


def test_handoff_delays_the_request_but_not_the_link() -> None:
    # Two 1-token prompts prefill together (10 + 1 = 11). The wire takes 1 ms each over a FIFO
    # link (11-12, 12-13); each lands 5 ms later (17, 18), so r0 steps 17-22 and r1 joins the
    # next step 22-27: TPOT (one decode step each, counted from the first token at 11) 11, 16.
    from planner.sim_spec import LinkSpec

    entry = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0))
    spec = InstanceSpec(StepModel(entry), 1, None)
    link = LinkSpec(1e6, 1.0, 1.0, 0.0, handoff_ms=5.0)  # 1 MB per token over 1 GB/s
    result = Simulator([1, 1], [2, 2], [0.0, 0.0], prefill=[spec], decode=[spec],
                       link=link).run()  # fmt: skip
    assert result.ttft_ms.tolist() == [11.0, 11.0]
    assert result.tpot_ms.tolist() == [11.0, 16.0]
