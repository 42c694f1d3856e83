"""An AdaptivePlacer with the cluster-level layout search on (router/adaptive/layout_model.py),
on the bench model's profile: while the layout is split it prefills on one instance and decodes
on the other, and local decodes running past their TPOT SLO call for the split before any of
them has ended."""

from __future__ import annotations

from router.adaptive import AdaptivePlacer, Placement
from router.policies import InstanceState
from router.worker_api import InstanceLoad, Role
from tests.router.test_layout_model import CHAT_OUTPUTS, CHATBOT, WINDOW_S, latency_model


def searching_placer(now: list[float]) -> tuple[AdaptivePlacer, list[InstanceState]]:
    """A placer with the layout search on, at the clock `now[0]`, and its two instances."""
    placer = AdaptivePlacer(
        latency_model(), clock=lambda: now[0], window_s=WINDOW_S, layout_search=True
    )
    return placer, [
        InstanceState(i, InstanceLoad(i, Role.ADAPTIVE, num_free_blocks=512)) for i in "ab"
    ]


def test_a_placer_with_the_search_on_prefills_on_one_instance_while_split():
    now = [0.0]
    placer, candidates = searching_placer(now)
    rate, kinds = 3.0, []
    running: dict[str, tuple[Placement, float]] = {}  # key -> (placement, placed at)
    for n in range(90):
        now[0] = n / rate
        # a request has its first token at the first arrival 0.2 s or more after it was placed
        # (at most 0.53 s: 0.27 of its TTFT SLO), and ends at the first 2 s or more after it
        # was placed, with 10 more tokens: TPOT past 0.14 s, past its SLO
        for key, (placement, placed_at) in list(running.items()):
            if placed_at + 0.2 <= now[0] < placed_at + 0.2 + 1 / rate:
                placer.prefilled(key, placement, None)
            elif now[0] >= placed_at + 2.0:
                placer.progress(key, placement, 11)
                placer.release(key, placement)
                del running[key]
        output = CHAT_OUTPUTS[n % 5]
        placement = placer.choose(179, output, CHATBOT, candidates)
        placer.placed(f"r{n}", placement, 179, output, CHATBOT)
        running[f"r{n}"] = (placement, now[0])
        kinds.append((placement.prefill_id, placement.decode_id))
    assert kinds[0][0] == kinds[0][1]  # before the window knew anything: local
    assert placer.split_prefill != ()
    (prefill,) = placer.split_prefill
    tail = kinds[-10:]
    assert all(p == prefill and d != prefill for p, d in tail), tail


def test_a_placer_splits_on_local_decodes_past_their_tpot_before_any_ends():
    now = [0.0]
    placer, candidates = searching_placer(now)
    rate = 3.0
    running: dict[str, tuple[Placement, float]] = {}  # key -> (placement, placed at)
    first: set[str] = set()
    for n in range(45):
        now[0] = n / rate
        # every request has its first token 0.2 s after it was placed, then a token every
        # 0.07 s (past its 0.048 s TPOT SLO), and none ends within the 15 s
        for key, (placement, placed_at) in running.items():
            if now[0] >= placed_at + 0.2:
                if key not in first:
                    first.add(key)
                    placer.prefilled(key, placement, None)
                placer.progress(key, placement, 1 + int((now[0] - placed_at - 0.2) / 0.07))
        placement = placer.choose(179, 400, CHATBOT, candidates)
        placer.placed(f"r{n}", placement, 179, 400, CHATBOT)
        running[f"r{n}"] = (placement, now[0])
    assert placer.layout is not None and not placer.layout.local  # none ended
    assert placer.split_prefill != ()
