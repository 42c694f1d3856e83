"""The adaptive placer's decisions (router/adaptive/placer.py and placement_model.py) on the
bench model's profile, with a clock the test moves: loose traffic runs where it is prefilled, a prompt
avoids the instance whose gate would hold it, a request decodes away from the prompts that would
be forced into its steps, and roles follow the remote placements of the window. How the model
learns the machine's speed and decode step: test_adaptive_learning.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.adaptive import WINDOW_S, AdaptivePlacer, Placement, RequestSLO
from router.adaptive.latency_model import LatencyModel
from router.adaptive.placement_model import InstanceView, Option, PlacementModel
from router.policies import InstanceState
from router.worker_api import InstanceLoad, LoadDetails, Role

PROFILE = Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json"
# The SLOs `pdserve bench --workloads mixed,shift` calibrated on the 2-core machine: summarization
# holds TPOT to two decode steps, chatbot to three and code to five; code's TTFT is 2.5 prefills.
SUMMARIZATION = RequestSLO(ttft_s=7.6, tpot_s=0.023)
CHATBOT = RequestSLO(ttft_s=3.3, tpot_s=0.098)
CODE = RequestSLO(ttft_s=0.3, tpot_s=0.06)


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


def states(*ids: str, **details: float) -> list[InstanceState]:
    return [
        InstanceState(
            i, InstanceLoad(i, Role.ADAPTIVE, num_free_blocks=512, details=LoadDetails(**details))
        )
        for i in ids
    ]


def place(
    placer: AdaptivePlacer,
    key: str,
    prompt: int,
    max_tokens: int,
    slo: RequestSLO,
    only: tuple[str, ...] = ("a", "b"),
) -> Placement:
    placement = placer.choose(prompt, max_tokens, slo, states(*only))
    placer.placed(key, placement, prompt, max_tokens, slo)
    return placement


def test_loose_traffic_runs_local_on_both_instances(placer: AdaptivePlacer, clock: Clock):
    placements = []
    for n in range(6):
        placements.append(place(placer, f"c{n}", 120, 200, CHATBOT))
        placer.prefilled(f"c{n}", placements[-1], None)
        clock.now += 0.5
    assert {p.kind for p in placements} == {"local"}
    assert {p.prefill_id for p in placements} == {"a", "b"}  # both decode
    assert placer.prefill_role == () and [k for _, k in placer.role_changes] == [0]


def test_requests_one_at_a_time_on_an_idle_cluster_take_turns(placer: AdaptivePlacer, clock: Clock):
    """Each ends before the next arrives, so every instance predicts the same: the tie goes to
    the instance chosen longest ago (else the first would take them all, and the other's gate
    would never learn its step costs)."""
    chosen = []
    for n in range(4):
        placement = place(placer, f"q{n}", 400, 12, CHATBOT)
        placer.release(f"q{n}", placement)
        chosen.append(placement.prefill_id)
        clock.now += 1.0
    assert chosen == ["a", "b", "a", "b"]


def test_a_prompt_avoids_the_instance_whose_gate_would_hold_it(placer: AdaptivePlacer):
    summary = place(placer, "s", 650, 16, SUMMARIZATION, only=("a",))
    placer.prefilled("s", summary, None)  # it decodes on a, with about 0.18 s of slack
    chat = place(placer, "c", 600, 64, CHATBOT)
    assert (chat.kind, chat.prefill_id) == ("local", "b")
    # Had a been the only instance, the prompt would wait for the summary's 15 steps there.
    held = placer.choose(600, 64, CHATBOT, states("a"))
    compute_s = placer.model.prefill_s(600, 1, 651.0)
    steps_s = 15 * placer.model.decode_step_s(1, 651.0)
    assert held.predicted_ttft_s == pytest.approx(compute_s + steps_s, rel=1e-6)
    assert chat.predicted_ttft_s == pytest.approx(placer.model.prefill_s(600), rel=1e-6)


def test_a_prompt_that_cannot_wait_is_forced_and_counts_the_decodes_it_breaks(
    placer: AdaptivePlacer,
):
    summary = place(placer, "s", 650, 16, SUMMARIZATION, only=("a",))
    placer.prefilled("s", summary, None)
    # A 300-token code prompt (TTFT 0.3 s) cannot wait out the summary's 15 steps on a: its
    # gate would run it onto them at once (holding would not save the summary); on b nothing
    # holds it and nothing is harmed.
    view = placer._instances["a"]
    forced = placer._predict.option("a", view, "a", view, 300, 0, 40, CODE, placer._clock())
    assert forced.harm == 1
    assert forced.ttft_s == pytest.approx(placer.model.prefill_s(300, 1, 651.0), rel=1e-6)
    code = place(placer, "c", 300, 40, CODE)
    assert (code.kind, code.prefill_id) == ("local", "b")
    assert code.predicted_ttft_s < 0.7 * CODE.ttft_s


def test_a_request_decodes_away_from_prompts_that_would_be_forced_into_its_steps(
    placer: AdaptivePlacer, clock: Clock
):
    for n in range(40):  # a has been taking code prompts: they cannot wait a decode out
        code = place(placer, f"c{n}", 200, 40, CODE, only=("a",))
        placer.prefilled(f"c{n}", code, None)
        placer.release(f"c{n}", code)
        clock.now += 0.2
    slo = RequestSLO(ttft_s=1.0, tpot_s=0.016)
    on_a = placer.choose(300, 30, slo, states("a"))
    assert on_a.predicted_tpot_s > slo.tpot_s  # the code prompts' share of its 30 steps
    placement = place(placer, "r", 300, 30, slo)
    assert (placement.kind, placement.prefill_id) == ("local", "b")


def test_prefill_where_the_cache_is_and_decode_where_the_batch_is_light(
    placer: AdaptivePlacer, clock: Clock
):
    for n in range(12):  # a decodes a large batch of long chat answers
        chat = place(placer, f"c{n}", 500, 400, CHATBOT, only=("a",))
        placer.prefilled(f"c{n}", chat, None)
    # A follow-up turn whose 560-token prefix a's cache holds: prefilling it anywhere else
    # breaks its TTFT, decoding it on a breaks its TPOT. Prefill on a, decode on b.
    slo = RequestSLO(ttft_s=0.25, tpot_s=0.022)
    placement = placer.choose(600, 64, slo, states("a", "b"), {"a": 560, "b": 0})
    assert (placement.kind, placement.prefill_id, placement.decode_id) == ("remote", "a", "b")
    assert placement.prefill_role_instances == 1 and placer.prefill_role == ("a",)
    assert placement.predicted_ttft_s <= slo.ttft_s and placement.predicted_tpot_s <= slo.tpot_s
    placer.placed("r", placement, 600, 64, slo)


def test_roles_follow_the_window_of_remote_placements(placer: AdaptivePlacer, clock: Clock):
    test_prefill_where_the_cache_is_and_decode_where_the_batch_is_light(placer, clock)
    went_remote_at = clock.now
    placer.release("r", Placement("a", "b", 0.0, 0.0, 1))
    for n in range(12):
        placer.release(f"c{n}", Placement("a", "a", 0.0, 0.0, 0))
    kinds = []
    for n in range(30):  # then chatbot traffic only, for longer than the window
        placement = place(placer, f"l{n}", 120, 200, CHATBOT)
        kinds.append(placement.kind)
        clock.now += 0.5
        placer.prefilled(f"l{n}", placement, None)
        placer.release(f"l{n}", placement)
    changes = list(placer.role_changes)
    assert [k for _, k in changes] == [0, 1, 0]
    assert changes[-1][0] - went_remote_at <= WINDOW_S + 0.5  # one window after the last remote
    assert placer.prefill_role == () and set(kinds) == {"local"}
    assert placer.num_tracked() == 0


def test_a_cached_prefix_draws_the_prefill_and_shortens_its_predicted_ttft(
    placer: AdaptivePlacer,
):
    cold = placer.choose(600, 200, CHATBOT, states("a", "b"))
    warm = placer.choose(600, 200, CHATBOT, states("a", "b"), {"a": 0, "b": 560})
    assert warm.kind == "local" and warm.prefill_id == "b"
    assert warm.predicted_ttft_s < 0.2 * cold.predicted_ttft_s
    assert warm.profiled_compute_s == pytest.approx(placer.model.profiled_prefill_s(40))


def test_an_instance_whose_decodes_are_past_their_slo_draws_no_more(
    placer: AdaptivePlacer, clock: Clock
):
    """Lost decodes have nothing left to protect, but they count whole: counted as nothing, the
    instance whose decodes are all late would look free and draw every request."""
    for n in range(3):  # b's three 20-token answers, stalled 3 s after their first token
        late = place(placer, f"late{n}", 300, 20, CHATBOT, only=("b",))
        placer.prefilled(f"late{n}", late, None)
    clock.now += 3.0
    view_b = placer._instances["b"]
    step_s = placer.model.decode_step_s(*view_b.decode_load())
    assert all(d.slack_s(clock.now, step_s) < 0 for d in view_b.decoding.values())
    for n in range(4):  # a's four on time, one step heavier than b's batch
        chat = place(placer, f"chat{n}", 300, 200, CHATBOT, only=("a",))
        placer.prefilled(f"chat{n}", chat, None)
    placement = place(placer, "r", 300, 200, CHATBOT)
    assert (placement.kind, placement.decode_id) == ("local", "a")


def test_the_predicted_tpot_is_at_least_the_time_between_tokens_an_instance_shows(
    placer: AdaptivePlacer, clock: Clock
):
    """b's one decode gets a token every 0.15 s (prompts the model did not foresee run beside
    it), a's two every decode step: a request whose TPOT SLO is 0.098 s decodes on a, though
    b's batch is lighter."""
    chats = {}
    for key, where in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        chats[key] = place(placer, key, 300, 200, CHATBOT, only=(where,))
        placer.prefilled(key, chats[key], None)
    tokens = dict.fromkeys(chats, 1)
    for tick in range(1, 61):  # 1.8 s of 30 ms ticks
        clock.now += 0.03
        for key, placement in chats.items():
            if key.startswith("a") or tick % 5 == 0:
                tokens[key] += 1
                placer.progress(key, placement, tokens[key])
    assert placer._instances["b"].observed_itl_s(clock.now) == pytest.approx(0.15, rel=1e-6)
    on_b = placer.choose(300, 200, CHATBOT, states("b"))
    assert on_b.predicted_tpot_s > 0.15
    placement = place(placer, "r", 300, 200, CHATBOT)
    assert placement.decode_id == "a" and placement.predicted_tpot_s < CHATBOT.tpot_s
    clock.now += 1.5  # b's decode stalls past what its average is trusted for: the model alone
    stale = placer.choose(300, 200, CHATBOT, states("b"))
    assert stale.predicted_tpot_s < 0.1


def test_a_slow_hand_off_raises_the_remote_tpot_until_it_is_a_window_old(
    placer: AdaptivePlacer, clock: Clock
):
    """The router times each remote request's first token to its second: what that took
    beyond the model's gap (transfer + a step and a half) joins every remote option's TPOT,
    and is forgotten a window after the last one measured (under load a hand-off can take
    many times the model's gap)."""
    test_prefill_where_the_cache_is_and_decode_where_the_batch_is_light(placer, clock)
    remote = placer.choose(
        600, 64, RequestSLO(ttft_s=0.25, tpot_s=0.022), states("a", "b"), {"a": 560, "b": 0}
    )
    assert remote.kind == "remote" and remote.predicted_handoff_s > 0
    placement = Placement("a", "b", 0.1, 0.02, 1, predicted_handoff_s=remote.predicted_handoff_s)
    placer.placed("h", placement, 600, 64, CHATBOT)
    placer.prefilled("h", placement, None)
    placer.progress("h", placement, 1)
    clock.now += remote.predicted_handoff_s + 0.6
    placer.progress("h", placement, 2)
    assert placer._predict.handoff_excess_s == pytest.approx(0.6, rel=1e-6)
    # On an instance with nothing decoding (so no time between tokens it shows), the remote
    # option's TPOT is the model's plus the excess, spread over the tokens after the first.
    empty, unlearned = InstanceView(), PlacementModel(placer.model, WINDOW_S)
    view_a = placer._instances["a"]
    slow = placer._predict.option("a", view_a, "c", empty, 600, 560, 64, CHATBOT, clock.now)
    model = unlearned.option("a", view_a, "c", empty, 600, 560, 64, CHATBOT, clock.now)
    assert slow.tpot_s - model.tpot_s == pytest.approx(0.6 / 63, rel=1e-6)
    clock.now += WINDOW_S + 0.1
    fresh = placer._predict.option("a", view_a, "c", empty, 600, 560, 64, CHATBOT, clock.now)
    assert fresh.tpot_s == pytest.approx(
        unlearned.option("a", view_a, "c", empty, 600, 560, 64, CHATBOT, clock.now).tpot_s
    )
    placer.release("h", placement)


def test_a_remote_option_that_misses_anyway_loses_a_tie_to_a_local_one():
    """Equal objectives broken: a request that misses its own SLO either way does not move
    its KV (the transfer costs both instances CPU and buys nothing), however the load reads."""
    slo = RequestSLO(ttft_s=0.3, tpot_s=0.06)
    local = Option("a", "a", ttft_s=0.5, tpot_s=0.05, harm=0, crowding=2.0)
    remote = Option("a", "b", ttft_s=0.5, tpot_s=0.01, harm=0, crowding=0.0)
    assert remote.score(slo)[0] == local.score(slo)[0] == 1
    assert remote.score(slo)[2] < local.score(slo)[2]  # lighter by the load alone
    assert min([remote, local], key=lambda o: o.score(slo)) is local
    # Meeting its own SLO where the local one breaks a decode, it still goes remote.
    harming = Option("a", "a", ttft_s=0.1, tpot_s=0.05, harm=1)
    meeting = Option("a", "b", ttft_s=0.2, tpot_s=0.05, harm=0)
    assert min([harming, meeting], key=lambda o: o.score(slo)) is meeting


def test_an_instance_whose_first_tokens_come_late_is_seen_behind(
    placer: AdaptivePlacer, clock: Clock
):
    """a's prompts have been getting their first token 0.3 s later than predicted (it fell
    behind): its TTFT prediction carries that lag, so a code prompt goes to b, and the lag is
    forgotten once a's first tokens are no longer fresh (without it the placer keeps placing
    on the instance that is missing every TTFT while the other meets them all)."""
    for n in range(4):
        late = place(placer, f"late{n}", 100, 2, CODE, only=("a",))
        clock.now += late.predicted_ttft_s - late.predicted_lag_s + 0.3  # the model's, + 0.3 s
        placer.prefilled(f"late{n}", late, None)
        placer.release(f"late{n}", late)
        clock.now += 0.05
    view_a = placer._instances["a"]
    assert view_a.observed_lag_s(clock.now) == pytest.approx(0.3, rel=1e-6)
    on_a = placer.choose(100, 60, CODE, states("a"))
    on_b = placer.choose(100, 60, CODE, states("b"))
    assert on_a.predicted_ttft_s == pytest.approx(on_b.predicted_ttft_s + 0.3, rel=1e-6)
    assert place(placer, "next", 100, 60, CODE).prefill_id == "b"
    # Still behind by 0.3 s: a prompt that comes as late as the lag said keeps the lag, it does
    # not read as on time (the lag is measured against the model, not against itself).
    behind = place(placer, "behind", 100, 2, CODE, only=("a",))
    assert behind.predicted_lag_s == pytest.approx(0.3, rel=1e-6)
    clock.now += behind.predicted_ttft_s
    placer.prefilled("behind", behind, None)
    placer.release("behind", behind)
    assert view_a.observed_lag_s(clock.now) == pytest.approx(0.3, rel=1e-6)
    clock.now += 2.5  # no first token from a for longer than its lag is trusted
    assert view_a.observed_lag_s(clock.now) == 0.0
    assert placer.choose(100, 60, CODE, states("a")).predicted_ttft_s == pytest.approx(
        on_b.predicted_ttft_s, rel=1e-6
    )


def test_a_remote_prompts_lateness_is_its_own_and_outlasts_an_idle_spell(
    placer: AdaptivePlacer, clock: Clock
):
    """a prefilled prompts for b that got their first token 0.1 s later than predicted (the
    hand-off's cost): a's remote option carries that after an idle spell, its local option does
    not (with nothing fresh to carry, a burst's first remote placements would be predicted at a
    third of the TTFT they take)."""
    for n in range(4):
        chosen = placer.choose(100, 20, CODE, states("a", "b"))
        remote = Placement("a", "b", chosen.predicted_ttft_s, chosen.predicted_tpot_s, 0)
        placer.placed(f"r{n}", remote, 100, 20, CODE)
        clock.now += remote.predicted_ttft_s + 0.1
        placer.prefilled(f"r{n}", remote, None)
        placer.release(f"r{n}", remote)
        clock.now += 0.05
    view_a, view_b = placer._instances["a"], placer._instances["b"]
    assert view_a.observed_lag_s(clock.now, remote=True) == pytest.approx(0.1, rel=1e-6)
    assert view_a.observed_lag_s(clock.now) == 0.0  # a's own prompts are not behind
    clock.now += 60.0  # idle, longer than a window
    options = {
        (a, b): placer._predict.option(a, views[0], b, views[1], 100, 0, 20, CODE, clock.now)
        for a, b, views in (("a", "b", (view_a, view_b)), ("a", "a", (view_a, view_a)))
    }
    assert options["a", "b"].lag_s == pytest.approx(0.1, rel=1e-6)
    assert options["a", "a"].lag_s == 0.0
    # the next remote prompt on time brings it down, as an average
    remote = Placement(
        "a",
        "b",
        options["a", "b"].ttft_s,
        options["a", "b"].tpot_s,
        0,
        predicted_lag_s=options["a", "b"].lag_s,
    )
    placer.placed("on-time", remote, 100, 20, CODE)
    clock.now += remote.predicted_ttft_s - remote.predicted_lag_s  # the model's, no lateness
    placer.prefilled("on-time", remote, None)
    assert view_a.observed_lag_s(clock.now, remote=True) == pytest.approx(0.075, rel=1e-6)


def test_a_requests_ttft_counts_from_the_choice_not_from_the_submission(
    placer: AdaptivePlacer, clock: Clock
):
    """The submission waits for the instance to take the request; the TTFT the placer learns
    from (its lag, the layout search's room) counts from when it chose, as its prediction did."""
    chosen = placer.choose(100, 20, CODE, states("a", "b"))
    clock.now += 0.05  # the submission's wait
    placer.placed("r", chosen, 100, 20, CODE)
    clock.now += 0.1
    placer.prefilled("r", chosen, None)
    decoding = placer._instances[chosen.decode_id].decoding["r"]
    assert decoding.ttft_objective() == pytest.approx(0.15 / CODE.ttft_s, rel=1e-6)
