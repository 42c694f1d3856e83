"""The cluster's layout for the traffic of the last window: how many of the adaptive instances
should prefill only (k), the others decoding only, or none (k = 0: every request chooses its
own placement, router/adaptive.py). DistServe's placement search, online, over what arrived.

Why the cluster needs it on top of the per-request choice: what a split buys is that the
decode instances see no prompts at all. One request placed remote does not buy that, while the
other requests keep prefilling beside its decode; so a placer that decides one request at a
time goes to the split only after the TPOT tail has crossed, and then half-way (measured on
chatbot at 2.07 req/s per core: 18 requests split and met their SLOs, 29 stayed local on the
prefilling instance, predicted and measured past their TPOT SLO).

The local layout is judged by what it does, the split by what it is predicted to do:

    local (k = 0)   measured: the TPOT and the worst objective (TTFT or TPOT), each over its
                    SLO, of every request that ran local and ended in the window (the router
                    relays every token), and of those still decoding with MIN_TOKENS_SO_FAR
                    tokens out, at their TPOT so far.
                    Its tail is what a prediction misses: two models of it were tried and both
                    put chatbot's local TPOT at 0.35-0.5 of its SLO where the runs measured
                    0.7-0.8 and crossed it (a mean-field one, and the planner's discrete-event
                    simulator with the engines' chunking at the speeds the run's calibration
                    measured): the steps slow down as both cores fill and the router and the
                    client take their share (the median time between tokens went from 10 to 19
                    ms as the rate rose), which neither model has.
    split (k > 0)   predicted in steady state from the latency model, for the window's
                    arrivals (rate lambda, each with its prompt n, output m and SLOs):
      decode instance   lambda_d = lambda / (N - k) requests per second decode on it; per
                        token step(B), B = lambda_d * E[m] * step (Little's law, a fixed
                        point), plus the hand-off's gap (transfer + half a step) over m - 1
      prefill instance  lambda_p = lambda / k, utilisation rho = lambda_p * E[c]; TTFT = c +
                        the M/G/1 wait lambda_p E[s^2] / (2 (1 - rho)) + the transfer, c at
                        the base speed (the fastest the first tokens show lately: the prompt
                        compute the workers measured beside decodes, on cores the router and
                        the other instance share, rose 1.7x with the load, 0.13 to 0.22 s, in
                        a chatbot run where one prefill-only core kept up with 3.16 req/s per
                        core); a prompt's share s of the core while others queue is c over
                        PREFILL_BATCH_GAIN (rho = lambda_p E[s]): a prefill-only core with a
                        queue runs several prompts in one step, and that costs less per prompt
                        than each alone (session 20's run K, chatbot: one prefill-only core
                        carried 15.3 requests/s of 179-token prompts, 56 of 60 inside their
                        TTFT SLO, 0.065 s each, where one alone took 0.12 s at the run's
                        calibrated speed; without the gain one core would be past what it
                        can carry from 4.1 req/s per core on, where the fixed disaggregated
                        layout attained 100% to 5.08 and 90% at 8.42)
                    The forecast says which splits can carry the window's prompts at all
                    (rho < 1), and which of those does best (with more than two instances:
                    how many prefill). It does not say whether to split: it is a steady
                    state, and the traffic that tells is not (a bench point is 60 requests,
                    a few seconds of arrivals whose decodes end seconds later: in run K's
                    chatbot the fixed split's decode core held 17 sequences at 13 requests/s
                    with 33 ms between tokens, where Little's law, at the speed the run's
                    calibration measured, puts the batch past 100 and the TPOT past its
                    SLO from 4 requests/s per core on, and the split attained 93%).
    the split, run  measured: the worst objective of each request placed after the split.

The cluster splits when at least TAIL of the window's local requests (MIN_DECODES of them or
more) missed their TPOT SLO and a split can carry the window's prompts: then the local layout
is failing the requests a split is for, and what the split does is measured from there on.
Still decoding counts: a burst's long answers end seconds after it began, and a tail of ended
requests alone came when most of it was placed (session 21, chatbot at 4.5-4.6 req/s per core:
runs O and P split after 49 and 48 of 60 arrivals, and attained 83% and 63%; the requests still
decoding, from their 16th token, showed the same tail after 29 and 15). So far is not final: of
O's and P's chatbot requests past their TPOT SLO at their 16th token, 60% ended past it (code
23%, whose local TTFTs leave no room for a split anyway; summarization 76%); a count past the
SLO by 1.2 was surer (76%) but showed the tail after 35 and 29 arrivals.
Missed, not at risk: a local layout whose requests end near their SLOs
still meets them, and the split it would move to is only predicted (session 19's
summarization split at 0.94 requests/s per core on 18% of local requests past RISK while every
local request met its SLOs, and 63% of the split's then missed, their decode steps 1.7x the
fixed disaggregated layout's at the same rate). TPOT, not TTFT: what a split buys is decodes
that see no prompts; it gives the prompts fewer cores, so local requests late to their first
token only get later (the code runs split on a tail of TTFT misses and lost 0.52-0.72x to
colocated, which the prefill gate alone beat by 1.34x). And only while the prompts have room:
the median TTFT of the window's local requests, ended or still decoding (a TTFT is whole at
the first token), at most TTFT_ROOM of its SLO. Still decoding counts here from the first token,
not the 16th: when the load steps up, the window's ended requests are those of the lower load
before, and a burst's first requests 16 tokens in are those whose prompts came before the
queue: in session 22's run Q, code, the router split 1.5 s into the 14.15 req/s per core point
on a median of 0.27, where the client's records of the local requests with a first token by
then give 0.40; it attained 43% where colocated attained 92%. The split gives the prompts k of
N cores, so each prefill-only core queues N/k times the prompts, and a local layout whose
first tokens already take a good share of their SLO has no room for that. Measured, the two
kinds of traffic stand far apart: where the split won (sessions 19-20, chatbot, mixed, shift),
the adaptive layout's local requests had a median TTFT of 0.05-0.25 of the SLO at the points
that split; where it lost (code, runs M and N, 0.75x and 0.53x, each a point lost to a split
taken on a TPOT tail of 1 request in 8), 0.58 and 0.65, and colocated code's held 0.41-0.55 at
the rates where a few TPOT misses showed beside them (runs L and M). Replayed through the
search (benchmarks/layout_replay.py, runs L and M), TTFT_ROOM 0.3 splits no code point and
every chatbot, mixed and shift point the search split before; 0.4 splits a third of run M's
colocated code at 9.76 req/s per core, where colocated attained 88%.

It goes back to k = 0 when the rate falls under BACK_RATE of the rate it split at (an idle spell alone does not: traffic that comes
back after one finds the layout it left, and the window judges it once it holds enough
arrivals), when its prefill instances are predicted past what they can carry (a rate or a mix
of prompts that would only queue up), or when more of the split's own requests miss an SLO than
TAIL and than the local layout's did when it split, or, under a lower rate than it split at
(below SAME_LOAD of it), more than TAIL: the local layout's misses were measured at the load it
split at, and the split must not keep running on their credit. Under a higher rate (above the
split's by 1/SAME_LOAD) they are no bar either way: the local layout, already past its TPOT
tail at the lower load, misses more TPOTs at this one, so the split goes back only when more
than TAIL of its requests miss their TTFT (its prompts on k cores where local gives them N), and
more than the local requests did when it split (at this load they would miss more). One miss is
no tail: it goes back for doing worse on MIN_MISSES of its requests or more (session 23's run V,
mixed: a split taken 9 s into the 2.12 req/s per core point went back 5 s later on 1 TTFT miss
in 8, and the point attained 72% where colocated attained 83%). In
session 22's run Q, chatbot, a split taken at 1.59 req/s per core (12% of local requests past
their TPOT) went back 3 s into the 4.35 point on 25% of its requests past an SLO, all TPOTs at
1.00-1.15 of it; the 40 requests placed local after it missed 29 TPOTs, and the refusal kept
the split away for 30 s (43% at 4.35, where the fixed split attained 97%). In run M's code the split taken
at 6.97 req/s per core (local requests 25% past their TPOT) ran on through the next point, 5.89,
where 19 of its 60 requests missed their TTFT and the local layout had met every SLO at 4.98,
since 32% was not worse than what the local layout did at 6.97. Then it does not split again for
REFUSE_WINDOWS windows, twice that after a second such split in a row, and so on (a split that
went back for the rate resets it): in session 20's run L, chatbot, a split tried at 2.53 req/s
per core did worse and went back, its refusal ran out at the next point, 2.14, the window's
local requests still those the 2.53 overload had left, and the split tried again there, 17 of
its 42 requests past their TPOT where colocated missed 2 of 60. For the same reason a layout
is judged only by the requests placed under it: local requests placed before a split went
back do not count toward the next one. A change waits DWELL of the window after the last one
(the window's arrivals and ended requests must be the new ones).

On by default (RouterConfig.adaptive_layout_search).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import NamedTuple

from engine.slo import RequestSLO
from router.latency_model import LatencyModel

RISK = 0.85  # a latency past this share of its SLO puts the request at risk (in a forecast)
TAIL = 0.1  # the share of local requests missing their TPOT SLO that calls for a split
TTFT_ROOM = 0.3  # a split only while the local requests' median TTFT is within this of its SLO
BACK_RATE = 0.6  # k = 0 again once the rate falls under this share of the rate split at
SAME_LOAD = 0.9  # a rate above this share of the rate split at is the load it split at
DWELL = 0.5  # of the window: no layout change sooner than this after the last one
REFUSE_WINDOWS = 3.0  # a split that did worse than the local layout: none for this many windows
# (doubled for each further one in a row)
MIN_ARRIVALS = 20  # a rate from fewer arrivals is noise (8 Poisson arrivals: +-35%)
MIN_DECODES = 8  # a tail from fewer ended requests is noise
MIN_MISSES = 2  # a split goes back for doing worse on at least this many of its requests' misses
MIN_TOKENS_SO_FAR = 16  # a request still decoding counts toward the tail from this many tokens
PREFILL_BATCH_GAIN = 1.8  # one prompt alone over its share of a step of several (see above)
FIXED_POINT_STEPS = 25

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    at: float
    num_tokens: int
    max_tokens: int
    slo: RequestSLO


class Ended(NamedTuple):
    """A request that ended: when, and its TTFT and TPOT as shares of their SLOs."""

    at: float
    ttft: float
    tpot: float


class Running(NamedTuple):
    """A local request still decoding: when it was placed, its tokens so far, and its TTFT and
    its TPOT so far as shares of their SLOs."""

    placed_at: float
    num_tokens: int
    ttft: float
    tpot: float


@dataclass(frozen=True)
class Forecast:
    """A split's prediction for the window: the share of its requests at risk, and their
    mean worst objective (TTFT or TPOT over its SLO)."""

    prefill_instances: int
    at_risk: float
    load: float
    utilisation: float = 0.0  # of its prefill instances (>= 1: they cannot carry the prompts)


class LayoutModel:
    """Keeps the window's arrivals, how its ended requests did, and the layout it chose
    (`prefill_instances`)."""

    def __init__(self, model: LatencyModel, window_s: float) -> None:
        self.model = model
        self.window_s = window_s
        self.arrivals: deque[Arrival] = deque()
        # the requests that ran local, and those that ran split and began after it
        self.local: deque[Ended] = deque()
        self.split: deque[Ended] = deque()
        self.prefill_instances = 0
        self.changed_at = float("-inf")
        self.split_rate = 0.0  # the rate the cluster split at
        self.split_tail = 0.0  # the share of local requests that missed an SLO when it split
        self.split_ttft_tail = 0.0  # and the share that missed their TTFT SLO
        self.refused_until = float("-inf")  # a split that did worse: none again until then
        self.failed_splits = 0  # splits in a row that went back for doing worse
        self.last: tuple[Forecast, ...] = ()  # every split's forecast at the last decision

    def note(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)
        self._forget(arrival.at)

    def note_ended(
        self, at: float, local: bool, placed_at: float, ttft: float, tpot: float
    ) -> None:
        """A request placed at `placed_at` ended at `at`, local or remote, its TTFT and TPOT
        `ttft` and `tpot` over their SLOs. A remote one counts for the split only if it was
        placed after the split (a remote placement of the local layout is not the split's); a
        local one only if it was placed after the last change."""
        if local:
            if placed_at >= self.changed_at:
                self.local.append(Ended(at, ttft, tpot))
        elif self.prefill_instances and placed_at >= self.changed_at:
            self.split.append(Ended(at, ttft, tpot))
        self._forget(at)

    def _forget(self, now: float) -> None:
        while self.arrivals and self.arrivals[0].at < now - self.window_s:
            self.arrivals.popleft()
        for ended in (self.local, self.split):
            while ended and ended[0].at < now - self.window_s:
                ended.popleft()

    def rate(self) -> float | None:
        """Arrivals per second over the window (None: too few to tell)."""
        if len(self.arrivals) < MIN_ARRIVALS:
            return None
        span = self.arrivals[-1].at - self.arrivals[0].at
        return (len(self.arrivals) - 1) / span if span > 0 else None

    @staticmethod
    def missed(
        ended: Sequence[Ended | Running], tpot_only: bool = False, ttft_only: bool = False
    ) -> float | None:
        """The share of `ended` that missed an SLO, or (`tpot_only`, `ttft_only`) that one
        (None: too few to tell)."""
        if len(ended) < MIN_DECODES:
            return None
        worst = (
            (lambda e: e.tpot)
            if tpot_only
            else (lambda e: e.ttft)
            if ttft_only
            else (lambda e: max(e.ttft, e.tpot))
        )
        return sum(worst(e) > 1.0 for e in ended) / len(ended)

    def local_so_far(self, running: Iterable[Running] = ()) -> list[Ended | Running]:
        """The window's local requests that ended under this layout, and those of `running`
        (placed under it) with MIN_TOKENS_SO_FAR tokens out, at their TPOT so far."""
        return [*self.local, *(r for r in running if r.num_tokens >= MIN_TOKENS_SO_FAR)]

    @staticmethod
    def ttft_room(local: Sequence[Ended | Running]) -> float | None:
        """The median TTFT over its SLO of `local` (None: too few)."""
        if len(local) < MIN_DECODES:
            return None
        return median(e.ttft for e in local)

    def update(self, num_instances: int, now: float, running: Iterable[Running] = ()) -> int:
        """The layout for the window's traffic on `num_instances` instances (k prefill-only);
        `running`: the local requests still decoding (the tail counts them from
        MIN_TOKENS_SO_FAR tokens on)."""
        self._forget(now)
        rate = self.rate()
        if self.prefill_instances >= num_instances:  # instances left: split fewer, or none
            self._change(
                max(0, num_instances - 1) if num_instances > 1 else 0,
                now,
                rate,
                f"{num_instances} instances left",
            )
        if num_instances < 2 or now - self.changed_at < DWELL * self.window_s:
            return self.prefill_instances
        current = self.prefill_instances
        if rate is None:  # too few arrivals to time: fewer than MIN_ARRIVALS a window
            # Sparse traffic for half a window is a low rate; an idle cluster whose traffic has
            # just come back is not, and it stays as it was until the window can tell.
            arrivals = self.arrivals
            seen_s = arrivals[-1].at - arrivals[0].at if arrivals else 0.0
            if current and seen_s >= self.window_s / 2:
                sparse_rate = (len(arrivals) - 1) / seen_s
                if sparse_rate < BACK_RATE * self.split_rate:
                    self.failed_splits = 0
                    self._change(0, now, rate, f"{len(arrivals)} arrivals in {seen_s:.1f} s")
            return self.prefill_instances
        self.last = tuple(self.forecast(num_instances, k, rate) for k in range(1, num_instances))
        viable = [f for f in self.last if f.utilisation < 1.0]
        split = min(viable, key=lambda f: (f.at_risk, f.load)) if viable else None
        if current == 0:
            running = [r for r in running if r.placed_at >= self.changed_at]
            local = self.local_so_far(running)
            tail = self.missed(local, tpot_only=True)
            if split and tail is not None and tail >= TAIL and now >= self.refused_until:
                # a TTFT is whole at the first token: every running request's counts (a median,
                # taken only once the tail calls for it)
                ttft = self.ttft_room([*self.local, *running])
                if ttft is not None and ttft <= TTFT_ROOM:
                    self.split_tail = self.missed(local) or 0.0
                    ttft_tail = self.missed([*self.local, *running], ttft_only=True)
                    self.split_ttft_tail = ttft_tail or 0.0
                    self._change(
                        split.prefill_instances,
                        now,
                        rate,
                        f"{tail:.0%} of local requests missed their TPOT SLO, their "
                        f"median TTFT {ttft:.2f} of its SLO; the split predicts "
                        f"{split.at_risk:.0%} at risk, its prefill instances "
                        f"{split.utilisation:.0%} busy",
                    )
            return self.prefill_instances
        # the local layout's misses are the bar only at the load they were measured at: under a
        # lower one the split must meet TAIL itself; under a higher one the local layout misses
        # more TPOTs than it did, and only the split's TTFT misses (its prompts on fewer cores),
        # past the TTFT misses local had at the lower load, can show it worse
        higher = rate * SAME_LOAD > self.split_rate
        split_tail = self.missed(self.split, ttft_only=higher)
        same = SAME_LOAD * self.split_rate <= rate
        bar = self.split_ttft_tail if higher else self.split_tail if same else 0.0
        if (
            split_tail is not None
            and split_tail > max(TAIL, bar)
            and round(split_tail * len(self.split)) >= MIN_MISSES
        ):
            self.failed_splits += 1  # it did worse: back, and no split for a while
            self.refused_until = now + REFUSE_WINDOWS * self.window_s * 2 ** (
                self.failed_splits - 1
            )
            self._change(
                0,
                now,
                rate,
                f"{split_tail:.0%} of the split's requests missed "
                f"{'their TTFT SLO' if higher else 'an SLO'}, against {bar:.0%} "
                "local",
            )
        elif self.last[current - 1].utilisation >= 1.0:
            self._change(
                0,
                now,
                rate,
                f"{current} prefill instances cannot carry the prompts "
                f"(utilisation {self.last[current - 1].utilisation:.2f})",
            )
        elif rate < BACK_RATE * self.split_rate:
            self.failed_splits = 0
            self._change(0, now, rate, f"the rate fell from {self.split_rate:.2f}/s")
        elif (
            split
            and split.prefill_instances != current
            and split.at_risk < self.last[current - 1].at_risk
        ):
            self._change(
                split.prefill_instances,
                now,
                rate,
                f"{split.prefill_instances} prefill instances predict fewer at risk",
            )
        return self.prefill_instances

    def _change(self, k: int, now: float, rate: float | None, reason: str) -> None:
        if k == self.prefill_instances:
            return
        logger.info(
            "layout: %d prefill-only instances (was %d) at %.2f requests/s: %s (model "
            "speed %.2f, base %.2f, decode %.2f)",
            k,
            self.prefill_instances,
            rate or 0.0,
            reason,
            self.model.speed,
            self.model.base_speed or 0.0,
            self.model.decode_speed or self.model.speed,
        )
        self.prefill_instances = k
        self.changed_at = now
        self.split.clear()
        if k:
            self.split_rate = rate or 0.0
            self.local.clear()  # what the next split needs is new local decodes

    def forecast(self, num_instances: int, k: int, rate: float) -> Forecast:
        """Split k's (1 <= k < num_instances) prediction for the window's arrivals at `rate`
        per second."""
        arrivals = self.arrivals
        model = self.model
        decode_rate = rate / (num_instances - k)
        mean_out = sum(a.max_tokens for a in arrivals) / len(arrivals)
        mean_ctx = sum(a.num_tokens + a.max_tokens / 2 for a in arrivals) / len(arrivals)
        step_s = model.decode_step_s(1, mean_ctx)
        for _ in range(FIXED_POINT_STEPS):
            batch = int(round(max(1.0, decode_rate * mean_out * step_s)))
            step_s = model.decode_step_s(batch, batch * mean_ctx)
        compute_s = [model.unloaded_prefill_s(a.num_tokens) for a in arrivals]
        prefill_rate = rate / k
        shares = [c / PREFILL_BATCH_GAIN for c in compute_s]
        rho = prefill_rate * sum(shares) / len(shares)
        if rho >= 1.0:
            return Forecast(k, 1.0, float("inf"), rho)
        wait_s = prefill_rate * sum(s * s for s in shares) / len(shares) / (2 * (1 - rho))
        at_risk = 0
        load = 0.0
        for arrival, c in zip(arrivals, compute_s, strict=True):
            transfer_s = model.transfer_s(arrival.num_tokens)
            ttft_s = wait_s + c + transfer_s
            tpot_s = step_s + (transfer_s + step_s / 2) / max(1, arrival.max_tokens - 1)
            worst = max(ttft_s / arrival.slo.ttft_s, tpot_s / arrival.slo.tpot_s)
            at_risk += worst > RISK
            load += worst
        return Forecast(k, at_risk / len(arrivals), load / len(arrivals), rho)
