"""What the adaptive placer's latency model learns from what it sees (router/adaptive/
latency_model.py), on the bench model's profile: the machine's speed from measured prompts, a base
speed that is the fastest lately and forgets a faster past, and the decode step's bias from the
steps the engines report, which a jump in the prefill speed leaves alone."""

from __future__ import annotations

import pytest

from router.adaptive import AdaptivePlacer
from router.adaptive.latency_model import LatencyModel
from tests.router.test_adaptive import CHATBOT, PROFILE, Clock, place, states


@pytest.fixture
def placer() -> AdaptivePlacer:
    return AdaptivePlacer(LatencyModel.from_file(str(PROFILE)), clock=Clock())


def test_the_model_learns_the_machine_speed(placer: AdaptivePlacer):
    placement = place(placer, "r", 400, 10, CHATBOT)
    assert placer.model.speed == 1.0
    for _ in range(30):
        placer.model.observe(placement.profiled_compute_s, 2.0 * placement.profiled_compute_s)
    assert placer.model.speed == pytest.approx(2.0, rel=0.02)
    assert placer.model.prefill_s(400) == pytest.approx(
        2.0 * 0.001 * (placer.model.step.prefill_stage_ms(400, 400.0**2)), rel=0.02
    )


def test_the_base_speed_is_the_fastest_lately_and_forgets_a_faster_past(placer: AdaptivePlacer):
    model = placer.model
    profiled_s = model.profiled_prefill_s(400)
    for ratio in [1.0] * 5 + [2.0] * 30:  # unloaded, then each prompt twice as slow (load)
        model.observe(profiled_s, ratio * profiled_s)
    assert model.speed == pytest.approx(2.0, rel=0.02)
    assert model.base_speed == pytest.approx(1.01**30, rel=1e-6)  # rising 1% a prompt at most
    assert model.unloaded_prefill_s(400) == pytest.approx(1.01**30 * profiled_s, rel=1e-6)
    model.observe(profiled_s, 1.0 * profiled_s)  # a fast one pulls it half-way down
    assert model.base_speed == pytest.approx((1.01**30 + 1.0) / 2, rel=1e-6)
    for _ in range(200):
        model.observe(profiled_s, 2.0 * profiled_s)
    assert model.base_speed == pytest.approx(2.0)  # it never passes what it is shown


def test_the_decode_bias_learns_from_the_steps_the_engines_report(placer: AdaptivePlacer):
    profiled_s = placer.model.decode_step_s(4, 0.0)
    for _ in range(40):  # each instance reports a 4-sequence step 1.5x the profile's
        placer.choose(
            200, 50, CHATBOT, states("a", "b", decode_step_s=1.5 * profiled_s, decode_batch=4)
        )
    assert placer.model.decode_bias == pytest.approx(1.5, rel=0.02)
    after = place(placer, "s", 200, 50, CHATBOT)
    assert after.decode_bias == pytest.approx(1.5, rel=0.02)
    assert after.predicted_tpot_s == pytest.approx(placer.model.decode_step_s(1, 200.0), rel=1e-6)
    # the prefill speed jumps (prompts measured in batches on a prefill-only instance): the
    # decode step the engines measure is what the decode prediction stays at
    decode_s = placer.model.decode_step_s(4, 0.0)
    placement = place(placer, "t", 400, 10, CHATBOT)
    for _ in range(30):
        placer.model.observe(placement.profiled_compute_s, 3.0 * placement.profiled_compute_s)
    assert placer.model.speed == pytest.approx(3.0, rel=0.02)
    assert placer.model.decode_step_s(4, 0.0) == decode_s
