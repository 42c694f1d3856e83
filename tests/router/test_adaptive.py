"""The adaptive placer's decisions (router/adaptive.py) on the bench model's profile, with a
clock the test moves: roles follow the traffic's tightness and come back when it changes,
placements follow the SLOs and the decodes' slack, and the model learns the machine's speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.adaptive import WINDOW_S, AdaptivePlacer, Placement, RequestSLO
from router.latency_model import LatencyModel
from router.policies import InstanceState
from router.worker_api import InstanceLoad, Role

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/results/placement/profile-2core.json"
# The bench's calibrated classes (benchmarks/results/goodput-2core/mix-session11): summarization
# holds TPOT to two decode steps, chatbot to three and code to five.
SUMMARIZATION = RequestSLO(ttft_s=7.6, tpot_s=0.046)
CHATBOT = RequestSLO(ttft_s=3.3, tpot_s=0.098)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def placer(clock: Clock) -> AdaptivePlacer:
    return AdaptivePlacer(LatencyModel.from_file(str(PROFILE)), clock=clock)


def states(*ids: str) -> list[InstanceState]:
    return [InstanceState(i, InstanceLoad(i, Role.ADAPTIVE, num_free_blocks=512)) for i in ids]


def place(placer: AdaptivePlacer, key: str, prompt: int, max_tokens: int, slo: RequestSLO
          ) -> Placement:  # fmt: skip
    placement = placer.choose(prompt, max_tokens, slo, states("a", "b"))
    placer.placed(key, placement, prompt, max_tokens, slo)
    return placement


def test_loose_traffic_runs_colocated_on_both_instances(placer: AdaptivePlacer, clock: Clock):
    placements = []
    for n in range(6):
        placements.append(place(placer, f"c{n}", 120, 200, CHATBOT))
        placer.prefilled(f"c{n}", placements[-1], None)
        clock.now += 0.5
    assert {p.kind for p in placements} == {"local"}
    assert {p.prefill_id for p in placements} == {"a", "b"}  # both decode
    assert placer.prefill_role == () and [k for _, k in placer.role_changes] == [0]


def test_tight_traffic_splits_prefill_from_decode(placer: AdaptivePlacer, clock: Clock):
    placements = [place(placer, f"s{n}", 650, 16, SUMMARIZATION) for n in range(4)]
    assert len(placer.prefill_role) == 1
    (prefill_id,) = placer.prefill_role
    for placement in placements:
        assert placement.kind == "remote"
        assert (placement.prefill_id, placement.decode_id) == (prefill_id, "b" if prefill_id ==
                                                                "a" else "a")  # fmt: skip
        assert placement.prefill_role_instances == 1
        assert placement.predicted_ttft_s > placer.model.prefill_s(650)  # the queue counts


def test_roles_follow_a_shift_from_tight_to_loose_traffic(placer: AdaptivePlacer, clock: Clock):
    for n in range(8):  # summarization for a while
        placement = place(placer, f"s{n}", 650, 16, SUMMARIZATION)
        assert placement.kind == "remote"
        clock.now += 1.0
        placer.prefilled(f"s{n}", placement, None)
        placer.release(f"s{n}", placement)
    shifted_at = clock.now
    kinds = []
    for n in range(30):  # then chatbot only
        placement = place(placer, f"c{n}", 120, 200, CHATBOT)
        kinds.append(placement.kind)
        clock.now += 0.5
        placer.prefilled(f"c{n}", placement, None)
        placer.release(f"c{n}", placement)
    changes = list(placer.role_changes)
    assert [k for _, k in changes] == [1, 0]
    assert changes[1][0] - shifted_at <= WINDOW_S + 0.5  # within one window of the last tight one
    assert placer.prefill_role == ()
    assert kinds[-5:] == ["local"] * 5
    assert placer.num_tracked() == 0


def test_a_loose_prefill_does_not_land_on_decodes_it_would_make_late(
    placer: AdaptivePlacer, clock: Clock
):
    # Summarization decodes on the decode-role instance, just started.
    for n in range(3):
        placement = place(placer, f"s{n}", 650, 16, SUMMARIZATION)
        placer.prefilled(f"s{n}", placement, None)
    decode_id = placement.decode_id
    # A long chatbot prompt: on the decode instance its prefill would eat those decodes' slack.
    chat = place(placer, "c", 600, 200, CHATBOT)
    assert chat.prefill_id != decode_id


def test_the_model_learns_the_machine_speed(placer: AdaptivePlacer):
    placement = place(placer, "r", 400, 10, CHATBOT)
    assert placer.model.speed == 1.0
    for _ in range(30):
        placer.model.observe(placement.profiled_compute_s, 2.0 * placement.profiled_compute_s)
    assert placer.model.speed == pytest.approx(2.0, rel=0.02)
    assert placer.model.prefill_s(400) == pytest.approx(2.0 * 0.001 * (
        placer.model.step.prefill_stage_ms(400, 400.0**2)), rel=0.02)  # fmt: skip


def test_a_cached_prefix_draws_the_prefill_and_shortens_its_predicted_ttft(
    placer: AdaptivePlacer,
):
    cold = placer.choose(600, 200, CHATBOT, states("a", "b"))
    warm = placer.choose(600, 200, CHATBOT, states("a", "b"), {"a": 0, "b": 560})
    assert warm.kind == "local" and warm.prefill_id == "b"
    assert warm.predicted_ttft_s < 0.2 * cold.predicted_ttft_s
    assert warm.profiled_compute_s == pytest.approx(placer.model.profiled_prefill_s(40))


def test_tpot_predictions_learn_from_the_measured_ones(placer: AdaptivePlacer):
    before = place(placer, "r", 200, 50, CHATBOT)
    for _ in range(30):  # every request decodes 1.5x slower than predicted
        placer.finished(before, 1.5 * before.predicted_tpot_s)
    assert placer.model.decode_bias == pytest.approx(1.5, rel=0.02)
    placer.release("r", before)
    after = place(placer, "s", 200, 50, CHATBOT)
    assert after.predicted_tpot_s == pytest.approx(1.5 * before.predicted_tpot_s, rel=0.05)
    assert after.decode_bias == pytest.approx(1.5, rel=0.02)


def test_roles_stay_off_when_one_prefill_queue_would_break_the_tight_ttfts(
    placer: AdaptivePlacer, clock: Clock
):
    # Short outputs (tight TPOT slack) but a TTFT of 1.2 prefills, arriving faster than one
    # instance prefills them: a prefill instance's queue would break them, so both replicas stay.
    code = RequestSLO(ttft_s=1.2 * placer.model.prefill_s(300), tpot_s=0.02)
    for n in range(12):
        placement = place(placer, f"c{n}", 300, 8, code)
        clock.now += 0.8 * placer.model.prefill_s(300)
    assert placer.prefill_role == () and placement.kind == "local"
