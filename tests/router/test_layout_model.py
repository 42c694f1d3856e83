"""The cluster-level layout search (router/layout_model.py) on the bench model's profile, at the
speed run A's chatbot calibration measured (1.45x the profile): chatbot traffic stays local
until its decodes' TPOT is at risk beside the prompts, then splits, and comes back when the rate
falls; summaries, whose short decodes the prefill gate protects, stay local; and a placer with
the search on prefills on one instance and decodes on the other while the layout is split."""

from __future__ import annotations

from pathlib import Path

from engine.slo import RequestSLO
from router.adaptive import AdaptivePlacer
from router.latency_model import LatencyModel
from router.layout_model import DWELL, MIN_ARRIVALS, Arrival, LayoutModel
from router.policies import InstanceState
from router.worker_api import InstanceLoad, Role

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/results/placement/profile-2core.json"
# Run A's calibrated SLOs (benchmarks/results/goodput-2core/adaptive-session13-A)
CHATBOT = RequestSLO(ttft_s=1.98, tpot_s=0.048)
SUMMARIZATION = RequestSLO(ttft_s=6.7, tpot_s=0.0346)
WINDOW_S = 10.0


def latency_model() -> LatencyModel:
    model = LatencyModel.from_file(str(PROFILE))
    model.speed = 1.45
    return model


def drive(layout: LayoutModel, rate: float, seconds: float, prompt: int, outputs: list[int],
          slo: RequestSLO, start: float = 0.0) -> list[int]:  # fmt: skip
    """Arrivals at `rate` for `seconds`; the layout chosen at each."""
    chosen = []
    for i in range(int(rate * seconds)):
        at = start + i / rate
        layout.note(Arrival(at, prompt, outputs[i % len(outputs)], slo))
        chosen.append(layout.update(2, at))
    return chosen


CHAT_OUTPUTS = [30, 60, 87, 120, 150]


def test_chatbot_splits_only_once_local_decodes_are_at_risk():
    for rate in (1.0, 2.0, 3.0):
        assert set(drive(LayoutModel(latency_model(), WINDOW_S), rate, 20, 179, CHAT_OUTPUTS,
                         CHATBOT)) == {0}, rate  # fmt: skip
    layout = LayoutModel(latency_model(), WINDOW_S)
    chosen = drive(layout, 4.5, 10, 179, CHAT_OUTPUTS, CHATBOT)
    assert chosen[: MIN_ARRIVALS - 1] == [0] * (MIN_ARRIVALS - 1)  # no rate from a handful
    assert chosen[-1] == 1
    local, split = layout.last
    assert local.at_risk > split.at_risk and local.load > split.load


def test_the_layout_comes_back_to_local_when_the_rate_falls():
    layout = LayoutModel(latency_model(), WINDOW_S)
    assert drive(layout, 4.5, 10, 179, CHAT_OUTPUTS, CHATBOT)[-1] == 1
    changed_at = layout.changed_at
    later = drive(layout, 1.5, 30, 179, CHAT_OUTPUTS, CHATBOT, start=10.0)
    assert later[-1] == 0
    assert layout.changed_at >= changed_at + DWELL * WINDOW_S  # no flip sooner than the dwell


def test_summaries_whose_decodes_the_gate_protects_stay_local():
    for rate in (0.5, 1.0, 2.0):
        chosen = drive(LayoutModel(latency_model(), WINDOW_S), rate, 20, 450, [10, 19, 30],
                       SUMMARIZATION)  # fmt: skip
        assert set(chosen) == {0}, rate


def test_a_single_instance_is_never_split():
    layout = LayoutModel(latency_model(), WINDOW_S)
    for i in range(60):
        layout.note(Arrival(i / 6.0, 179, 87, CHATBOT))
        assert layout.update(1, i / 6.0) == 0


def test_a_placer_with_the_search_on_prefills_on_one_instance_while_split():
    now = [0.0]
    placer = AdaptivePlacer(latency_model(), clock=lambda: now[0], window_s=WINDOW_S,
                            layout_search=True)  # fmt: skip
    candidates = [
        InstanceState(i, InstanceLoad(i, Role.ADAPTIVE, num_free_blocks=512)) for i in "ab"
    ]
    kinds = []
    for n in range(45):
        now[0] = n / 4.5
        placement = placer.choose(179, CHAT_OUTPUTS[n % 5], CHATBOT, candidates)
        placer.placed(f"r{n}", placement, 179, CHAT_OUTPUTS[n % 5], CHATBOT)
        kinds.append((placement.prefill_id, placement.decode_id))
        if n % 3 == 0:  # some finish, so the views do not only grow
            placer.release(f"r{n}", placement)
    assert placer.split_prefill != ()
    (prefill,) = placer.split_prefill
    tail = kinds[-10:]
    assert all(p == prefill and d != prefill for p, d in tail), tail
    assert kinds[0][0] == kinds[0][1]  # before the window knew the rate: local
