"""The serving path's terms: per-sequence step cost, the TTFT path, the relay's share of the
cores, and their round trip through a profile file (times in ms)."""

from __future__ import annotations

import numpy as np
import pytest

from planner.latency import StepModel
from planner.profile import ModelProfile, TPProfile, load_profile, save_profiles
from planner.serving_path import (
    Relay,
    apply_serving_path,
    relay_of,
    relay_scale,
    simulate_relayed,
    ttft_path_ms,
)
from planner.sim_spec import InstanceSpec, SimOptions, SimResult
from planner.simulator import Simulator

PATH = {
    "worker_step_ms": 1.0,
    "worker_step_wall_ms": 2.0,
    "worker_seq_ms": 0.5,
    "relay_request_ms": 1.0,
    "relay_token_ms": 0.5,
    "path_ttft_ms": 7.0,
}


def _profile() -> ModelProfile:
    entry = TPProfile(
        (10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0), serving_path=PATH
    )
    return ModelProfile("m", {1: entry})


def test_relay_share_of_the_cores() -> None:
    # 10 req/s x (1 + 50 x 0.5) ms = 0.26 cores over 2 cores: each step takes 1 / (1 - 0.13).
    assert relay_scale(Relay(1.0, 0.5), 10.0, 50.0, 2) == pytest.approx(1 / 0.87)
    assert relay_scale(Relay(), 10.0, 50.0, 2) == 1.0
    # + 100 emitting steps a second x 0.6 ms + 20 ms a second idle: 0.34 cores over 2
    assert relay_scale(Relay(1.0, 0.5, 0.6, 20.0), 10.0, 50.0, 2, steps_per_s=100.0) == (
        pytest.approx(1 / 0.83)
    )


def test_relay_step_cost_takes_the_step_rate_of_a_first_pass() -> None:
    # Prefill 10 + 1 = 11, then 9 decode steps of 5 (45): 10 steps in 56 ms, 178.6 a second.
    # A 1 ms relay step needs 0.1786 of a core; it finds both instances busy (nowhere idle to
    # run) 11/56 x 45/56 of the time, and takes that part off the one core: every step takes
    # 1 / (1 - 0.1786 x 0.158) as long in the second pass.
    entry = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0))
    spec = InstanceSpec(StepModel(entry), 1, None)
    runs: list[float] = []

    def run(options: SimOptions) -> SimResult:
        runs.append(options.step_scale)
        return Simulator([10], [10], [0.0], prefill=[spec], decode=[spec], options=options).run()

    first = run(SimOptions())
    assert (first.num_steps, first.end_ms, first.busy_ms) == (10, 56.0, (11.0, 45.0))
    assert first.all_busy(1) == pytest.approx(11 / 56 * 45 / 56)
    runs.clear()
    result = simulate_relayed(run, SimOptions(), Relay(step_ms=1.0), 1.0, 10.0, 1)
    scale = 1 / (1 - 10 / 0.056 / 1e3 * (11 / 56 * 45 / 56))
    assert runs == [1.0, pytest.approx(scale)]
    assert result.ttft_ms.tolist() == [pytest.approx(11 * scale)]
    assert simulate_relayed(run, SimOptions(), Relay(), 1.0, 10.0, 1).end_ms == 56.0


def test_the_relay_takes_only_what_finds_every_core_busy() -> None:
    # Two colocated replicas busy 90% and 50% of the run on two cores: a relay wake-up finds
    # no idle core 45% of the time. A device no instance holds is always idle.
    done = SimResult(np.zeros(1), np.zeros(1), end_ms=100.0, busy_ms=(90.0, 50.0), devices=(1, 1))
    assert done.all_busy(2) == pytest.approx(0.45)
    assert done.all_busy(3) == 0.0
    wide = SimResult(np.zeros(1), np.zeros(1), end_ms=100.0, busy_ms=(50.0,), devices=(2,))
    assert wide.all_busy(2) == pytest.approx(0.5)  # one TP=2 instance: its cores step together
    # 0.26 cores of relay over 2 cores, found all busy 45% of the time: 0.0585 of each
    assert relay_scale(Relay(1.0, 0.5), 10.0, 50.0, 2, all_busy=0.45) == pytest.approx(
        1 / (1 - 0.0585)
    )


def test_terms_reach_the_timeline() -> None:
    # Step cost: the larger of CPU (1) and wall (2) per step, + 0.5 per sequence. Two prompts
    # prefill in one batch: (10 + 1) + 2 + 2 x 0.5 = 14, doubled by step_scale 2 -> 28, plus
    # the 7 ms TTFT path. Then one decode step of both: (5 + 2 + 1) x 2 = 16.
    profile = apply_serving_path(_profile())
    spec = InstanceSpec(StepModel(profile.tp(1)), 1, None)
    options = SimOptions(ttft_path_ms=ttft_path_ms(profile), step_scale=2.0)
    result = Simulator(
        [10, 10], [2, 2], [0.0, 0.0], prefill=[spec], decode=[spec], options=options
    ).run()
    assert result.ttft_ms.tolist() == [35.0, 35.0]
    assert result.tpot_ms.tolist() == [16.0, 16.0]


def test_serving_path_round_trips_through_the_file(tmp_path) -> None:
    path = tmp_path / "p.json"
    save_profiles(path, {"m": apply_serving_path(_profile())})
    loaded = load_profile(path)
    assert loaded.tp(1).serving_path == PATH
    assert loaded.tp(1).overhead_per_seq == 0.5
    assert relay_of(loaded) == Relay(1.0, 0.5)


def test_handoff_delays_the_request_but_not_the_link() -> None:
    # Two 1-token prompts prefill together (10 + 1 = 11). The wire takes 1 ms each over a FIFO
    # link (11-12, 12-13); each lands 5 ms later (17, 18), so r0 steps 17-22 and r1 joins the
    # next step 22-27: TPOT (one decode step each, counted from the first token at 11) 11, 16.
    from planner.sim_spec import LinkSpec

    entry = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0))
    spec = InstanceSpec(StepModel(entry), 1, None)
    link = LinkSpec(1e6, 1.0, 1.0, 0.0, handoff_ms=5.0)  # 1 MB per token over 1 GB/s
    result = Simulator([1, 1], [2, 2], [0.0, 0.0], prefill=[spec], decode=[spec], link=link).run()
    assert result.ttft_ms.tolist() == [11.0, 11.0]
    assert result.tpot_ms.tolist() == [11.0, 16.0]


def test_kv_cpu_lengthens_the_sender_step_and_the_receiver_next_step() -> None:
    # Prompt of 10 tokens: prefill 10 + 1 (pp constant) = 11, plus the send's CPU 2 + 0.1 x 10
    # = 3 on the same core: the first token at 14. The wire is free (no bytes) and instant; the
    # landing costs the decode core 1 + 0.2 x 10 = 3, charged to the step that follows it:
    # 14 -> 14 + 5 + 3 = 22, then 22 -> 27: TPOT (2 decode steps) (27 - 14) / 2 = 6.5.
    from planner.sim_spec import LinkSpec

    entry = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), overhead=(0.0, 0.0))
    spec = InstanceSpec(StepModel(entry), 1, None)
    link = LinkSpec(0.0, 1.0, 1.0, 0.0, send_cpu_ms=(2.0, 0.1), receive_cpu_ms=(1.0, 0.2))
    result = Simulator([10], [3], [0.0], prefill=[spec], decode=[spec], link=link).run()
    assert result.ttft_ms.tolist() == [14.0]
    assert result.tpot_ms.tolist() == [6.5]


def test_measured_link_carries_the_path_terms() -> None:
    from planner.serving_path import measured_link

    path = {
        "handoff_ms": 3.0,
        "kv_send_ms": 2.0,
        "kv_send_ms_per_token": 0.01,
        "kv_receive_ms": 1.0,
        "kv_receive_ms_per_token": 0.02,
    }
    bare = TPProfile((10.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0), kv_bytes_per_token=8.0)
    assert measured_link(bare) is None  # no channel measured
    from dataclasses import replace

    link = measured_link(
        replace(bare, transfer_GBps=2.0, transfer_per_message_ms=0.5, serving_path=path)
    )
    assert link is not None
    assert (link.intra_node_GBps, link.per_message_ms, link.handoff_ms) == (2.0, 0.5, 3.0)
    assert link.send_ms(100) == pytest.approx(3.0)
    assert link.receive_ms(100) == pytest.approx(3.0)
