"""The cluster-level layout search (router/adaptive/layout_model.py) on the bench model's profile, at the
speed a chatbot calibration on the 2-core machine measured (1.45x the profile): the cluster splits when its
local requests miss their TPOT SLO and the split predicts them safe, not before (not on local
requests that only came near their SLOs, nor on local TTFT misses, which a split worsens); it comes back when the
rate falls, when the split cannot keep up, or when the split's own requests did worse than the
local ones did (and refuses to split again for a while). The placer with it: test_layout_placer.py."""

from __future__ import annotations

from pathlib import Path

from engine.slo import RequestSLO
from router.adaptive import layout_model
from router.adaptive.latency_model import LatencyModel
from router.adaptive.layout_model import Arrival, LayoutModel

PROFILE = Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json"
# Chatbot and summarization SLOs as `pdserve bench` calibrated them on the 2-core machine
CHATBOT = RequestSLO(ttft_s=1.98, tpot_s=0.048)
SUMMARIZATION = RequestSLO(ttft_s=6.7, tpot_s=0.0346)
WINDOW_S = 10.0
CHAT_OUTPUTS = [30, 60, 87, 120, 150]
RISK, MIN_DECODES = layout_model.RISK, layout_model.MIN_DECODES
MISSED = 1.05  # a latency past its SLO
REFUSE_S = layout_model.REFUSE_WINDOWS * WINDOW_S
QUARTER = [MISSED, 0.5, 0.5, 0.5]  # a quarter of the requests missed
# Code SLOs as `pdserve bench` calibrated them on the 2-core machine
CODE = RequestSLO(ttft_s=0.253, tpot_s=0.050)


def latency_model() -> LatencyModel:
    model = LatencyModel.from_file(str(PROFILE))
    model.speed = 1.45
    return model


def drive(
    layout: LayoutModel,
    rate: float,
    seconds: float,
    prompt: int,
    outputs: list[int],
    slo: RequestSLO,
    start: float = 0.0,
    worst: float | list[float] | None = None,
    local: bool = True,
    tpot: bool = True,
) -> list[int]:
    """Arrivals at `rate` for `seconds`, each also ending a request placed a second before
    with `worst` as its worst objective (in turn, from a list; None: none ends), its TPOT
    (`tpot`, its TTFT then 0.2 of its SLO) or else its TTFT; the layout chosen at each."""
    chosen = []
    worsts = worst if isinstance(worst, list) else [worst]
    for i in range(int(rate * seconds)):
        at = start + i / rate
        if (ended := worsts[i % len(worsts)]) is not None:
            layout.note_ended(at, local, at - 1.0, 0.2 if tpot else ended, ended if tpot else 0.5)
        layout.note(Arrival(at, prompt, outputs[i % len(outputs)], slo))
        chosen.append(layout.update(2, at))
    return chosen


def test_chatbot_splits_once_its_local_requests_miss_their_tpot_and_not_before():
    for rate in (1.0, 3.0, 4.5):  # however busy, local requests that meet their SLOs, even
        for worst in (0.6, RISK + 0.1):  # near them, keep it local
            layout = LayoutModel(latency_model(), WINDOW_S)
            chosen = drive(layout, rate, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=worst)
            assert set(chosen) == {0}, (rate, worst)
    layout = LayoutModel(latency_model(), WINDOW_S)
    chosen = drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=MISSED)
    handful = layout_model.MIN_ARRIVALS - 1  # no rate from fewer arrivals
    assert chosen[:handful] == [0] * handful
    assert chosen[-1] == 1
    (split,) = layout.last
    assert split.at_risk == 0.0 and split.load < RISK


def test_local_requests_late_to_their_first_token_do_not_split():
    # code completion's tail: TTFT misses, which fewer prefill cores would only make worse
    layout = LayoutModel(latency_model(), WINDOW_S)
    chosen = drive(layout, 3.0, 20, 97, [62], CODE, worst=MISSED, tpot=False)
    assert set(chosen) == {0}
    assert layout.missed(layout.local) == 1.0 and layout.missed(layout.local, True) == 0.0


def code_tail(ttft: float) -> tuple[LayoutModel, list[int]]:
    """Code at 6.5 req/s: one local request in eight ends past its TPOT SLO (1.05 of it), every
    first token at `ttft` of its SLO; the layout chosen at each arrival."""
    layout, chosen = LayoutModel(latency_model(), WINDOW_S), []
    for i in range(60):
        at, missed = i / 6.5, i % 8 == 0
        layout.note_ended(at, True, at - 1.0, ttft, 1.05 if missed else 0.5)
        layout.note(Arrival(at, 97, 48, CODE))
        chosen.append(layout.update(2, at))
    return layout, chosen


def test_local_requests_whose_first_tokens_have_no_room_do_not_split():
    # code at 3.27 req/s per core: one local request in eight past its TPOT SLO, their median
    # TTFT 0.65 of its SLO; a split (one prefill core for every prompt) would lose the point
    layout, chosen = code_tail(0.65)
    assert set(chosen) == {0}
    assert layout.missed(layout.local, True) >= layout_model.TAIL
    assert layout.ttft_room(layout.local) == 0.65
    # the same tail with first tokens at a fifth of their SLO (as chatbot's are): split
    layout, chosen = code_tail(0.2)
    assert chosen[-1] == 1


def running_tail(tokens: int, placed_at: float = 0.0) -> list[int]:
    """Chatbot at 3 req/s: nothing has ended, and every request placed at least 4 s before
    decodes with `tokens` out, one in four at 1.05 of its TPOT SLO so far; the layouts chosen."""
    layout, chosen = LayoutModel(latency_model(), WINDOW_S), []
    for i in range(30):
        at = i / 3.0
        running = [
            layout_model.Running(placed_at or j / 3.0, tokens, 0.1, QUARTER[j % 4])
            for j in range(max(0, i - 12))
        ]
        layout.note(Arrival(at, 179, 87, CHATBOT))
        chosen.append(layout.update(2, at, running))
    return chosen


def test_requests_still_decoding_past_their_tpot_call_for_the_split():
    # a burst's long answers end seconds after it began; their tail shows while they decode
    assert running_tail(layout_model.MIN_TOKENS_SO_FAR)[-1] == 1
    # a TPOT over fewer tokens is not yet a measure
    assert set(running_tail(layout_model.MIN_TOKENS_SO_FAR - 1)) == {0}


def test_a_split_whose_requests_do_well_stays_split():
    layout = LayoutModel(latency_model(), WINDOW_S)
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=MISSED)[-1] == 1
    later = drive(layout, 3.0, 30, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=0.5, local=False)
    assert set(later) == {1} and len(layout.split) >= MIN_DECODES


def test_a_few_ended_requests_are_not_a_tail():
    layout = LayoutModel(latency_model(), WINDOW_S)
    for i in range(layout_model.MIN_ARRIVALS + 5):
        at = i / 3.0
        if i < MIN_DECODES - 1:
            layout.note_ended(at, True, at - 1.0, 0.0, 2.0)
        layout.note(Arrival(at, 179, 87, CHATBOT))
        assert layout.update(2, at) == 0


def test_the_layout_comes_back_to_local_when_the_rate_falls():
    layout = LayoutModel(latency_model(), WINDOW_S)
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=1.2)[-1] == 1
    changed_at = layout.changed_at
    later = drive(layout, 1.0, 40, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=0.5, local=False)
    assert later[-1] == 0
    # no change sooner than the dwell after the last
    assert layout.changed_at >= changed_at + layout_model.DWELL * WINDOW_S


def test_an_idle_spell_alone_does_not_undo_the_split():
    layout = LayoutModel(latency_model(), WINDOW_S)
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=MISSED)[-1] == 1
    # nothing for 30 s (three windows), then the same traffic: split from its first arrival on
    after = drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, start=50.0, worst=0.5, local=False)
    assert set(after) == {1}


def test_a_split_that_does_worse_goes_back_and_is_refused_for_a_while():
    layout = LayoutModel(latency_model(), WINDOW_S)
    local_worsts = [MISSED, 0.5, 0.5, 0.5]  # a quarter of the local requests missed
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=local_worsts)[-1] == 1
    assert layout.split_tail == 0.25
    split_at = layout.changed_at
    # half of the split's own requests end past their SLO: more than the local ones did
    later = drive(
        layout, 3.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=[1.5, 0.5], local=False
    )
    assert later[-1] == 0 and layout.changed_at > split_at
    back_at = layout.changed_at
    assert layout.refused_until == back_at + layout_model.REFUSE_WINDOWS * WINDOW_S
    # local requests at risk again: no split until the refusal runs out, then one
    seconds = layout_model.REFUSE_WINDOWS * WINDOW_S + 10
    again = drive(layout, 3.0, seconds, 179, CHAT_OUTPUTS, CHATBOT, start=30.0, worst=1.2)
    times = [30.0 + i / 3.0 for i in range(len(again))]
    assert all(k == 0 for k, at in zip(again, times, strict=True) if at < layout.refused_until)
    assert again[-1] == 1


def test_under_a_lower_load_a_split_must_meet_the_tail_itself():
    layout = LayoutModel(latency_model(), WINDOW_S)
    # local requests at 3 req/s: half of them miss
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=[MISSED, 0.5])[-1] == 1
    assert layout.split_tail == 0.5
    # at the same load, a split missing a third does better than local did: it stays
    same = drive(
        layout, 3.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=[1.5, 0.5, 0.5], local=False
    )
    assert set(same) == {1}
    # at 2.4 req/s (below SAME_LOAD of 3), missing a third is a split failing: back
    lower = drive(
        layout, 2.4, 10, 179, CHAT_OUTPUTS, CHATBOT, start=30.0, worst=[1.5, 0.5, 0.5], local=False
    )
    assert lower[-1] == 0 and layout.failed_splits == 1


def test_under_a_higher_load_a_split_is_judged_by_its_ttfts():
    layout = LayoutModel(latency_model(), WINDOW_S)
    # local requests at 2 req/s: a quarter of them miss their TPOT
    assert drive(layout, 2.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=QUARTER)[-1] == 1
    # at 4 req/s a split whose TPOTs miss twice as often as local's did at 2 stays: local would
    # miss more there (a chatbot split that went back at 4.35 req/s per core left local
    # requests missing 29 TPOTs of 40)
    higher = drive(
        layout, 4.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=[MISSED, 0.5], local=False
    )
    assert set(higher) == {1}
    # its prompts late on one core where local gave them two: back
    late = drive(
        layout,
        4.0,
        10,
        179,
        CHAT_OUTPUTS,
        CHATBOT,
        start=30.0,
        worst=QUARTER,
        local=False,
        tpot=False,
    )
    assert late[-1] == 0 and layout.failed_splits == 1


def test_one_miss_is_no_tail_and_a_higher_load_is_judged_against_local_ttft_misses():
    layout = LayoutModel(latency_model(), WINDOW_S)
    # local requests at 2 req/s: a quarter miss their TPOT, and a few more their TTFT
    for i in range(MIN_DECODES):
        layout.note_ended(9.0 + i / 10, True, 8.0, MISSED if i < 6 else 0.2, 0.5)
    assert drive(layout, 2.0, 20, 179, CHAT_OUTPUTS, CHATBOT, start=1.0, worst=QUARTER)[-1] == 1
    assert 0.15 < layout.split_ttft_tail < 0.3
    split_at = layout.changed_at

    def split_ended(ttfts: list[float], start: float) -> None:
        for i, ttft in enumerate(ttfts):
            layout.note_ended(start + i / 10, False, split_at + 0.5, ttft, 0.5)

    # at 4 req/s: 1 TTFT miss in the split's first 8 (12.5%, over TAIL) is noise: it stays
    split_ended([MISSED] + [0.3] * (MIN_DECODES - 1), split_at + 4)
    assert set(drive(layout, 4.0, 2, 179, CHAT_OUTPUTS, CHATBOT, start=split_at + 5)) == {1}
    # 3 in 16: fewer than local missed when it split, where local would miss more now: it stays
    split_ended([MISSED, MISSED] + [0.3] * (MIN_DECODES - 2), split_at + 7)
    assert set(drive(layout, 4.0, 2, 179, CHAT_OUTPUTS, CHATBOT, start=split_at + 8)) == {1}
    # half of them late on one core where local gave them two: back
    late = drive(
        layout,
        4.0,
        10,
        179,
        CHAT_OUTPUTS,
        CHATBOT,
        start=split_at + 10,
        worst=[MISSED, 0.5],
        local=False,
        tpot=False,
    )
    assert late[-1] == 0 and layout.failed_splits == 1


def test_splits_that_keep_doing_worse_are_refused_longer_each_time():
    layout = LayoutModel(latency_model(), WINDOW_S)
    start, refusals = 0.0, []
    for _ in range(3):
        # local requests miss, a split is tried (once any refusal has run out), does worse
        chosen = drive(
            layout,
            3.0,
            30 + refusals[-1] if refusals else 20,
            179,
            CHAT_OUTPUTS,
            CHATBOT,
            start=start,
            worst=QUARTER,
        )
        assert chosen[-1] == 1
        start += len(chosen) / 3.0
        later = drive(
            layout, 3.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=start, worst=1.5, local=False
        )
        assert later[-1] == 0
        start += len(later) / 3.0
        refusals.append(layout.refused_until - layout.changed_at)
    assert [round(r, 6) for r in refusals] == [REFUSE_S, 2 * REFUSE_S, 4 * REFUSE_S]
    # a split that holds until the rate falls clears the count
    drive(layout, 3.0, 4 * REFUSE_S + 10, 179, CHAT_OUTPUTS, CHATBOT, start=start, worst=MISSED)
    assert layout.prefill_instances == 1 and layout.failed_splits == 3
    start = layout.changed_at + 1
    drive(layout, 1.0, 40, 179, CHAT_OUTPUTS, CHATBOT, start=start, worst=0.5, local=False)
    assert layout.prefill_instances == 0 and layout.failed_splits == 0


def test_local_requests_placed_before_a_split_went_back_do_not_call_for_the_next():
    layout = LayoutModel(latency_model(), WINDOW_S)
    assert drive(layout, 3.0, 20, 179, CHAT_OUTPUTS, CHATBOT, worst=QUARTER)[-1] == 1
    later = drive(layout, 3.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=20.0, worst=1.5, local=False)
    assert later[-1] == 0
    back_at = layout.changed_at
    # the overload's local requests end after the refusal, all placed before it went back
    at = layout.refused_until + 1.0
    for i in range(4 * MIN_DECODES):
        layout.note_ended(at + i / 10, True, back_at - 1.0, 0.0, MISSED)
    assert layout.missed(layout.local) is None
    # new traffic whose local requests meet their SLOs: no split
    after = drive(layout, 3.0, 10, 179, CHAT_OUTPUTS, CHATBOT, start=at + 4.0, worst=0.5)
    assert set(after) == {0}


def test_a_split_whose_prefill_instance_cannot_keep_up_is_not_taken():
    # long summaries at a rate one prefill core cannot carry: local requests at risk or not,
    # the split predicts worse, so the cluster stays local
    layout = LayoutModel(latency_model(), WINDOW_S)
    chosen = drive(layout, 3.0, 20, 1500, [10, 19, 30], SUMMARIZATION, worst=1.3)
    assert set(chosen) == {0}
    (split,) = layout.last
    assert split.at_risk == 1.0


def k_model() -> LatencyModel:
    """The profile at the speeds a chatbot calibration on the 2-core machine measured."""
    model = LatencyModel.from_file(str(PROFILE))
    model.speed = 1.03
    model.decode_speed = 1.31
    return model


K_CHATBOT = RequestSLO(ttft_s=1.415, tpot_s=0.0454)


def test_a_prefill_only_core_is_forecast_with_its_batched_steps():
    # Measured: one prefill-only core carried chatbot's 179-token prompts at 5.08 req/s per core
    # (100%) and 7.12 (93%); one prompt at a time, it would be past the core from 4.1 on
    for rate in (5.08, 7.12):
        layout = LayoutModel(k_model(), WINDOW_S)
        drive(layout, 2 * rate, 10, 179, CHAT_OUTPUTS, K_CHATBOT)
        assert layout.last[0].utilisation < 1.0, rate
    # and a rate past what batching buys is still past it (at 9.96, 34 of 60 TTFTs missed)
    layout = LayoutModel(k_model(), WINDOW_S)
    drive(layout, 2 * 9.96, 10, 179, CHAT_OUTPUTS, K_CHATBOT)
    assert layout.last[0].utilisation >= 1.0 and layout.last[0].at_risk == 1.0


def test_a_split_taken_is_judged_by_its_requests_until_its_prefill_core_cannot_carry_them():
    layout = LayoutModel(k_model(), WINDOW_S)
    # local requests miss their TPOT at a rate whose steady state the forecast puts at risk:
    # the split is taken, since the local layout is failing them
    assert drive(layout, 10.0, 20, 179, CHAT_OUTPUTS, K_CHATBOT, worst=MISSED)[-1] == 1
    assert layout.last[0].at_risk > 0.5
    # the rate rises, its requests do well: it stays
    later = drive(
        layout, 13.0, 20, 179, CHAT_OUTPUTS, K_CHATBOT, start=20.0, worst=0.6, local=False
    )
    assert set(later) == {1} and layout.last[0].utilisation < 1.0
    # past what its prefill core can carry at all: back
    after = drive(
        layout, 20.0, 10, 179, CHAT_OUTPUTS, K_CHATBOT, start=40.0, worst=0.6, local=False
    )
    assert after[-1] == 0 and layout.refused_until == float("-inf")


def test_a_single_instance_is_never_split():
    layout = LayoutModel(latency_model(), WINDOW_S)
    for i in range(60):
        layout.note_ended(i / 6.0, True, i / 6.0 - 1, 0.0, 2.0)
        layout.note(Arrival(i / 6.0, 179, 87, CHATBOT))
        assert layout.update(1, i / 6.0) == 0
