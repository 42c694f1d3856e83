"""How the placer counts the decodes a placement harms (router/adaptive/placement_model.py): against
each decode's TPOT SLO itself, not the gate's target."""

from __future__ import annotations

import pytest

from engine.slo import TPOT_TARGET
from router.adaptive import AdaptivePlacer
from router.adaptive.latency_model import LatencyModel
from router.adaptive.placement_model import Decoding, InstanceView
from tests.router.test_adaptive import CODE, PROFILE, SUMMARIZATION, Clock


@pytest.fixture
def placer() -> AdaptivePlacer:
    return AdaptivePlacer(LatencyModel.from_file(str(PROFILE)), clock=Clock())


@pytest.mark.parametrize("past_slo", [False, True])
def test_a_forced_prompt_harms_a_decode_only_when_it_takes_it_past_its_slo_itself(
    placer: AdaptivePlacer, past_slo: bool
):
    """The gate runs a code prompt onto a summary it cannot wait for. When what the prompt adds
    eats only the gate's margin (the slack to TPOT_TARGET), the summary still meets its SLO: no
    harm. Counted as harm, the instance whose decodes were already lost would look cheaper and
    draw nearly all of code's prompts."""
    now, model = placer._clock(), placer.model
    view = InstanceView()
    own_s = model.prefill_s(300, 1, 651.0)
    step_s = model.decode_step_s(1, 651.0)
    margin_s = (1 - TPOT_TARGET) * SUMMARIZATION.tpot_s * 15  # what the gate keeps back
    gate_slack_s = own_s - (1.2 * margin_s if past_slo else 0.5 * margin_s)
    first_at = now + gate_slack_s + 15 * step_s - TPOT_TARGET * SUMMARIZATION.tpot_s * 15
    view.decoding["s"] = Decoding(
        650, 16, SUMMARIZATION.tpot_s, first_token_at=first_at, num_tokens=1, last_token_at=first_at
    )
    summary = view.decoding["s"]
    assert 0 <= summary.slack_s(now, step_s) < own_s  # the gate would hold it if it could
    assert (summary.slo_slack_s(now, step_s) < own_s) is past_slo
    forced = placer._predict.option("a", view, "a", view, 300, 0, 40, CODE, now)
    assert forced.ttft_s == pytest.approx(own_s, rel=1e-6)  # holding would not save it: run
    assert forced.harm == int(past_slo)
