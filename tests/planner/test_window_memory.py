"""The decode side's KV memory under a model whose every layer slides: a request lands with its
whole context, then holds at most its window (`kv_window_tokens`), as the engine gives back the
blocks before it. Memory counts come from DecodeSide's own sums, checked against a hand count."""

from __future__ import annotations

import numpy as np

from planner.decode_group import DecodeSide, RequestTable
from planner.latency import StepModel
from planner.profile import TPProfile
from planner.sim_spec import InstanceSpec
from planner.simulator import Simulator

NO_OVERHEAD = (0.0, 0.0)


def _run(window: int | None, prompts: list[int], steps: list[int]) -> list[int]:
    """Step every request to its end on one side; `used` after each step."""
    side = DecodeSide(RequestTable(prompts, steps), capacity=None, max_seqs=None, window=window)
    side.waiting.extend(range(len(prompts)))
    used = []
    now = 0.0
    while side.has_work():
        group, _, _ = side.form()
        now += 1.0
        side.advance(group, now)
        used.append(side.used)
    return used


def test_used_tokens_stop_growing_at_the_window() -> None:
    prompts, steps = [10, 30], [20, 5]
    # whole contexts: r0 10 -> 30 tokens (+1 for the next token counted at each step), r1 30 -> 35
    assert _run(None, prompts, steps)[:5] == [42, 44, 46, 48, 50 - 35]
    # window 16: r0 grows 10 -> 16 then stays; r1 (30) holds 16 from the start
    used = _run(16, prompts, steps)
    hand = []
    for step in range(1, 21):
        r0 = min(10 + step, 16)
        r1 = 16 if step < 5 else 0
        hand.append(r0 + r1 if step < 20 else 0)
    assert used == hand
    assert used[-1] == 0


def test_the_window_goes_through_the_profile_json() -> None:
    triple = (5.0, 0.0, 0.0)
    profile = TPProfile(triple, triple, triple, kv_window_tokens=48)
    assert TPProfile.from_json("p", profile.to_json()).kv_window_tokens == 48
    assert "kv_window_tokens" not in TPProfile(triple, triple, triple).to_json()


def test_a_window_avoids_the_preemptions_of_whole_contexts() -> None:
    prompts = [60] * 8
    outputs = [200] * 8

    def run(window: int | None) -> int:
        triple = (5.0, 0.0, 0.0)
        decode = TPProfile(triple, triple, triple, overhead=NO_OVERHEAD, kv_window_tokens=window)
        prefill = TPProfile((1.0, 0.01, 0.0), triple, triple, overhead=NO_OVERHEAD)
        result = Simulator(
            prompts,
            outputs,
            [0.0] * 8,
            prefill=[InstanceSpec(StepModel(prefill), 1, None, 0)],
            decode=[InstanceSpec(StepModel(decode), 1, 1000, 0)],
        ).run()
        assert np.isfinite(result.tpot_ms).all()
        return result.num_preemptions

    assert run(None) > 0  # 8 x 260 tokens against 1000
    assert run(96) == 0  # 8 x 96 fit
