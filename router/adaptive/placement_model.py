"""What one placement option of an adaptive request is predicted to give (placer.py
chooses among them). Pure Python over the router's own view of each instance.

An option is (A, B): prefill on A, decode on B (A == B: local). The instances' engines schedule
by SLO (engine/slo.py): a prompt chunk waits while it would break a running decode's TPOT SLO,
until its own TTFT SLO cannot wait. So, for a request of `n` prompt tokens and `m` output tokens:

    own      its prompt's compute on A, beside A's decodes
    budget   TTFT_TARGET x ttft_slo - queued on A - own [- transfer]: how long the gate lets
             the prompt wait
    hold     how long A's gate keeps it back: the longest remaining run, within the budget, of
             A's decodes whose slack does not fit `own` (their slack: the time left before
             their TPOT SLO breaks, less the steps they still need); those that run longer it
             is run onto at once (holding would not save them), and each it takes past its
             SLO itself counts as harmed (past the gate's TPOT_TARGET alone is no miss, else
             the instance whose decodes are already lost would draw the prompts)
    TTFT     queued on A + hold + own [+ transfer] + lag, how much later than predicted A's
             first tokens have come lately: an instance that fell behind is seen behind
    window   m x B's step: how long it decodes on B
    forced   prompts that will run beside its decode on B although it is tight: B's queued ones
             and the ones the last window placed on B, pro rata, whose TTFT cannot wait `window`
    TPOT     B's step with it added + (forced [+ the hand-off's gap]) / (m - 1), and at
             least the time between tokens B's decodes show now, plus its step's growth
    gap      the transfer + half a step, plus what the last hand-offs took beyond that (the
             transfer waits for both engines to be between steps, which dominates under load)
    harm     + decodes on B its joining slows past their SLO
    crowding the share of each A or B decode's slack it uses, summed (a decode past its SLO
             counts whole, else an instance whose decodes are all late would look free)

Why each term is there, and what it was measured against: docs/design/adaptive-placement.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.slo import MARGIN_FRACTION, TPOT_TARGET, TTFT_TARGET, RequestSLO
from router.adaptive.latency_model import LatencyModel

# What moving the KV must win, in the score's units (TTFT and TPOT as shares of their SLOs):
# a remote placement is taken over a local one that meets the same objectives only when it
# predicts latencies lower by this much (the transfer costs both instances CPU on this machine,
# which the prediction does not count).
REMOTE_COST = 0.15
# The time between tokens an instance's decodes show is averaged over about this many tokens,
# and trusted for this long after the last one (past that, its decodes have ended or stalled,
# and the model alone predicts).
ITL_TOKENS = 20
ITL_FRESH_S = 1.0
# The same for the first tokens an instance's prompts show: what they took beyond their
# predicted TTFT, averaged over about this many prompts, trusted for this long after the last.
LAG_PROMPTS = 4
LAG_FRESH_S = 2.0
HANDOFF_ALPHA = 0.3  # weight of each hand-off measured, in the gap's average excess


@dataclass(frozen=True)
class Queued:
    """A prompt placed on an instance whose first token is not in yet."""

    compute_s: float
    deadline: float  # the router's clock: when its TTFT SLO runs out
    placed_at: float = 0.0  # the router's clock
    # The model's TTFT without the instance's lag: the lag learns what the model misses, so it
    # is measured against the model alone (against a prediction that already carried it, it
    # would learn the error of its own correction, and fall to 0 while the instance is behind).
    model_ttft_s: float = 0.0
    remote: bool = False  # prefilled here for another instance


@dataclass
class Decoding:
    """A request decoding (or about to) on an instance, as far as its slack goes."""

    num_prompt_tokens: int
    max_tokens: int
    tpot_slo_s: float
    first_token_at: float | None = None  # the router's clock
    num_tokens: int = 0
    last_token_at: float | None = None  # when the router last saw its tokens grow
    placed_at: float = 0.0  # the router's clock
    ttft_slo_s: float = math.inf
    local: bool = False  # prefilled where it decodes

    def ttft_objective(self) -> float:
        """Its TTFT over its SLO (0 before its first token)."""
        if self.first_token_at is None:
            return 0.0
        return (self.first_token_at - self.placed_at) / self.ttft_slo_s

    def tpot_objective(self) -> float:
        """Its TPOT so far over its SLO (0 before its second token)."""
        if self.first_token_at is None or self.last_token_at is None or self.num_tokens < 2:
            return 0.0
        tpot_s = (self.last_token_at - self.first_token_at) / (self.num_tokens - 1)
        return tpot_s / self.tpot_slo_s

    def remaining(self) -> int:
        """Decode steps still to run."""
        return max(0, self.max_tokens - max(self.num_tokens, 1))

    def slack_s(self, now: float, step_s: float) -> float:
        """How long it may still be stalled before its TPOT breaks its SLO, as the engine's gate
        counts it: to TPOT_TARGET x its SLO, or, once past that, to the SLO itself (negative:
        it misses either way, and the gate no longer protects it)."""
        slack_s = self._slack_s(now, step_s, TPOT_TARGET)
        return slack_s if slack_s >= 0 else self._slack_s(now, step_s, 1.0)

    def slo_slack_s(self, now: float, step_s: float) -> float:
        """How long it may still be stalled and meet its TPOT SLO itself (negative: it misses
        either way). A stall that eats the gate's margin (the slack to TPOT_TARGET) but not
        this one is no miss, so harm counts against it."""
        return self._slack_s(now, step_s, 1.0)

    def _slack_s(self, now: float, step_s: float, target: float) -> float:
        target_s = target * self.tpot_slo_s
        if self.first_token_at is None:  # not decoding yet: its whole budget is ahead
            return (target_s - step_s) * max(0, self.max_tokens - 1)
        deadline = self.first_token_at + target_s * (self.max_tokens - 1)
        return deadline - now - self.remaining() * step_s


@dataclass(frozen=True)
class _Prompt:
    at: float
    compute_s: float
    wait_s: float  # how long it could wait and still meet its TTFT SLO (ttft_slo - compute)


@dataclass
class InstanceView:
    """The router's view of one instance: prompts queued, requests decoding, recent prompts,
    and the time between tokens its decodes have shown lately."""

    queued: dict[str, Queued] = field(default_factory=dict)
    decoding: dict[str, Decoding] = field(default_factory=dict)
    prompts: deque[_Prompt] = field(default_factory=deque)  # placed here, oldest first
    itl_s: float = 0.0  # average time between tokens, over the last ITL_TOKENS or so
    itl_at: float = -math.inf  # when it was last measured
    lag_s: float = 0.0  # average first token past its predicted TTFT, over LAG_PROMPTS or so
    lag_at: float = -math.inf
    remote_lag_s: float = 0.0  # the same for the prompts it prefilled for another instance
    remote_lag_at: float = -math.inf

    def note_prompt(self, at: float, compute_s: float, wait_s: float) -> None:
        self.prompts.append(_Prompt(at, compute_s, wait_s))

    def forget_before(self, at: float) -> None:
        while self.prompts and self.prompts[0].at < at:
            self.prompts.popleft()

    def decode_load(self) -> tuple[int, float]:
        """(batch, sum of contexts) of the requests decoding there."""
        batch = len(self.decoding)
        sum_ctx = sum(d.num_prompt_tokens + d.num_tokens for d in self.decoding.values())
        return batch, float(sum_ctx)

    def note_tokens(self, decoding: Decoding, num_tokens: int, now: float) -> None:
        """`decoding` has `num_tokens` tokens at `now`: the time since its last ones, per
        token, joins the instance's average (stalls included: it is what its TPOT is made of)."""
        last_at, num_new = decoding.last_token_at, num_tokens - decoding.num_tokens
        decoding.num_tokens = max(decoding.num_tokens, num_tokens)
        if num_new <= 0:
            return
        decoding.last_token_at = now
        if last_at is None:
            return
        gap_s = (now - last_at) / num_new
        if self.itl_at < now - ITL_FRESH_S:
            self.itl_s = gap_s  # nothing recent to average with
        else:
            weight = 1.0 - (1.0 - 1.0 / ITL_TOKENS) ** num_new
            self.itl_s += weight * (gap_s - self.itl_s)
        self.itl_at = now

    def note_first_token(self, queued: Queued, now: float) -> None:
        """A prompt placed here has its first token: how late it came against its prediction
        joins the instance's average for its kind, local or remote (early counts too, as a
        negative lag)."""
        lag_s = (now - queued.placed_at) - queued.model_ttft_s
        if queued.remote:  # held until the next remote one (see observed_lag_s)
            if self.remote_lag_at == -math.inf:
                self.remote_lag_s = lag_s
            else:
                self.remote_lag_s += (lag_s - self.remote_lag_s) / LAG_PROMPTS
            self.remote_lag_at = now
        elif self.lag_at < now - LAG_FRESH_S:
            self.lag_s = lag_s
            self.lag_at = now
        else:
            self.lag_s += (lag_s - self.lag_s) / LAG_PROMPTS
            self.lag_at = now

    def observed_lag_s(self, now: float, remote: bool = False) -> float:
        """How much later than predicted its first tokens have come lately (0: none lately, or
        on time), for a prompt prefilled here for another instance (`remote`) or for itself.

        A local prompt's lag is trusted LAG_FRESH_S: it is how far the instance is behind. A
        remote prompt's is mostly the hand-off's (the KV staged and sent, the first token relayed
        once the decode instance takes it), which an idle spell does not take away: it is held
        until the next remote prompt measures it again. Forgotten, a burst's first remote
        placements after an idle spell predict TTFTs a third of those they take: a short remote
        prompt takes about twice a local one's time to its first token."""
        if remote:
            return max(0.0, self.remote_lag_s)
        return max(0.0, self.lag_s) if self.lag_at >= now - LAG_FRESH_S else 0.0

    def observed_itl_s(self, now: float) -> float | None:
        """The recent time between tokens, if its decodes have shown one lately."""
        return self.itl_s if self.itl_at >= now - ITL_FRESH_S else None


@dataclass(frozen=True)
class Option:
    prefill_id: str
    decode_id: str
    ttft_s: float
    tpot_s: float
    harm: int
    crowding: float = 0.0
    handoff_s: float = 0.0  # remote: its first token to its second, as the model alone predicts
    lag_s: float = 0.0  # the prefill instance's first-token lag its TTFT carries

    @property
    def remote(self) -> bool:
        return self.prefill_id != self.decode_id

    def score(self, slo: RequestSLO) -> tuple[int, int, float]:
        """Objectives broken; then whether it moves the KV of a request that misses anyway;
        then the load it adds: to itself, relative to what it allows, to the decodes it joins,
        relative to their slack, and REMOTE_COST for moving the KV.

        A remote option that breaks the request's own objective loses a tie on objectives to
        a local one: the transfer costs both instances CPU, and when the request is lost
        either way it buys nothing: at the top rates, remote placements predicted past their TTFT
        SLO measured slower than the local ones placed beside them."""
        own_misses = int(self.ttft_s > slo.ttft_s) + int(self.tpot_s > slo.tpot_s)
        load = self.ttft_s / slo.ttft_s + self.tpot_s / slo.tpot_s + self.crowding
        lost_transfer = int(self.remote and own_misses > 0)
        return self.harm + own_misses, lost_transfer, load + (REMOTE_COST if self.remote else 0.0)


class PlacementModel:
    """Predicts options from the latency model and the instances' views."""

    def __init__(self, model: LatencyModel, window_s: float) -> None:
        self.model = model
        self.window_s = window_s
        # What the hand-offs measured lately took beyond the model's gap (averaged), and when
        # the last was measured: past a window it is forgotten (the load it came from is gone,
        # and a gap no remote placement tries again would never be measured again).
        self.handoff_excess_s = 0.0
        self.handoff_at = -math.inf

    def observe_handoff(self, predicted_s: float, measured_s: float, now: float) -> None:
        """A remote request's first token to its second: `predicted_s` by the model alone
        (its option's `handoff_s`), `measured_s` as the router saw it."""
        excess_s = measured_s - predicted_s
        if self.handoff_at < now - self.window_s:
            self.handoff_excess_s = excess_s
        else:
            self.handoff_excess_s += HANDOFF_ALPHA * (excess_s - self.handoff_excess_s)
        self.handoff_at = now

    def _handoff_excess_s(self, now: float) -> float:
        return self.handoff_excess_s if self.handoff_at >= now - self.window_s else 0.0

    def option(
        self,
        prefill_id: str,
        prefill: InstanceView,
        decode_id: str,
        decode: InstanceView,
        num_tokens: int,
        num_cached: int,
        max_tokens: int,
        slo: RequestSLO,
        now: float,
    ) -> Option:
        model = self.model
        remote = prefill is not decode
        own_s = model.prefill_s(num_tokens - num_cached, *prefill.decode_load())
        queued_s = sum(q.compute_s for q in prefill.queued.values())
        transfer_s = model.transfer_s(num_tokens) if remote else 0.0
        budget_s = TTFT_TARGET * slo.ttft_s - queued_s - own_s - transfer_s  # as the gate's
        hold_s, harm = self._hold(prefill, own_s, budget_s, now)
        lag_s = prefill.observed_lag_s(now, remote)
        ttft_s = queued_s + hold_s + own_s + transfer_s + lag_s
        prefill_step_s = model.decode_step_s(*prefill.decode_load())
        crowding = sum(  # the share of A's decodes' slack its prompt takes
            _share(own_s, d.slack_s(now, prefill_step_s)) for d in prefill.decoding.values()
        )

        batch, sum_ctx = decode.decode_load()
        step_s = model.decode_step_s(batch + 1, sum_ctx + num_tokens)
        window_s = max_tokens * step_s
        forced_s = self._forced_s(decode, window_s, ttft_s, now, queue_ahead=not remote)
        gap_s = transfer_s + step_s / 2 if remote else 0.0
        if remote:
            gap_s = max(0.0, gap_s + self._handoff_excess_s(now))
        tpot_s = step_s + (forced_s + gap_s) / max(1, max_tokens - 1)
        current_s = model.decode_step_s(batch, sum_ctx)
        slower_s = step_s - current_s  # each step of B's decodes, with it added
        observed_s = decode.observed_itl_s(now) if batch else None
        if observed_s is not None:  # what B's decodes see now, with its own step added
            tpot_s = max(tpot_s, observed_s + slower_s)
        for d in decode.decoding.values():
            used_s = slower_s * min(d.remaining(), max_tokens)
            if 0 <= d.slo_slack_s(now, current_s) < used_s:
                harm += 1  # its joining alone breaks this one
            crowding += _share(used_s, d.slack_s(now, current_s))
        handoff_s = transfer_s + step_s / 2 + step_s if remote else 0.0
        return Option(prefill_id, decode_id, ttft_s, tpot_s, harm, crowding, handoff_s, lag_s)

    def _hold(
        self, view: InstanceView, own_s: float, budget_s: float, now: float
    ) -> tuple[float, int]:
        """(how long the instance's gate holds the prompt, the decodes it is run onto)."""
        step_s = self.model.decode_step_s(*view.decode_load())
        runs = [
            (d.remaining() * step_s, d.slo_slack_s(now, step_s))
            for d in view.decoding.values()
            if 0 <= d.slack_s(now, step_s) < (1 + MARGIN_FRACTION) * own_s
        ]
        saved = [run_s for run_s, _ in runs if run_s <= budget_s]  # the gate waits for these
        # and runs onto the rest: harmed are those it takes past their SLO itself
        broken = sum(1 for run_s, slo_slack_s in runs if run_s > budget_s and slo_slack_s < own_s)
        return max(saved, default=0.0), broken

    def _forced_s(
        self, view: InstanceView, window_s: float, start_s: float, now: float, queue_ahead: bool
    ) -> float:
        """Prompt compute the gate will run beside a decode of `window_s` starting in `start_s`
        on this instance: queued prompts that cannot wait until it ends (none when they are
        ahead of it, prefilled before it starts), and the window's placements there, pro rata,
        that could not wait that long either."""
        forced_s = 0.0
        if not queue_ahead:
            end = now + start_s + window_s
            forced_s += sum(
                q.compute_s for q in view.queued.values() if q.deadline - q.compute_s < end
            )
        urgent_s = sum(p.compute_s for p in view.prompts if p.wait_s < window_s)
        return forced_s + urgent_s * min(1.0, window_s / self.window_s)


def _share(used_s: float, slack_s: float) -> float:
    """The share of a decode's slack that `used_s` takes; a decode past its SLO counts whole
    (it is lost, and an instance whose decodes are late is no place to add more)."""
    if slack_s < 0:
        return 1.0
    return min(1.0, used_s / max(slack_s, 1e-6))
