"""The cluster's layout for the traffic of the last window: how many of the adaptive instances
should prefill only (k), the others decoding only, or none (k = 0: every request chooses its
own placement, the per-request placer). DistServe's placement search, online, over what arrived.

A split buys decode instances that see no prompts at all; one request placed remote does not, so
a per-request placer reaches the split late and half-way. This search decides for the cluster.

The local layout is judged by what it does, the split by what it is predicted to do:

    local (k = 0)   measured: each local request's TPOT and worst objective over its SLO, for
                    those that ended in the window and those still decoding with at least
                    MIN_TOKENS_SO_FAR tokens out (at their TPOT so far). Its tail is measured,
                    not modelled: steps slow as both cores fill, which no model here captures.
    split (k > 0)   predicted in steady state for the window's arrivals (rate lambda, each with
                    its prompt n, output m and SLOs) from the latency model:
      decode instance   lambda_d = lambda / (N - k); per token step(B), B = lambda_d * E[m] *
                        step (Little's law, a fixed point), plus the hand-off's gap over m - 1
      prefill instance  lambda_p = lambda / k; TTFT = c + the M/G/1 wait
                        lambda_p E[s^2] / (2 (1 - rho)) + the transfer, c at the base speed,
                        s = c / PREFILL_BATCH_GAIN (a queued prefill-only core batches prompts)
                    The forecast says which splits can carry the prompts (rho < 1) and which
                    does best; not whether to split, since a bench point is no steady state.

It splits when at least TAIL of the window's local requests (MIN_DECODES or more) missed their
TPOT SLO, a split can carry the prompts, and the median local TTFT is at most TTFT_ROOM of its
SLO. It goes back when the rate falls under BACK_RATE of the split's, when its prefill instances
are predicted overloaded, or when its own requests do worse (at least MIN_MISSES) than the local
layout did; after such a return it refuses to split for REFUSE_WINDOWS windows, doubling in a row.
A change waits DWELL of the window. The reasoning, the evidence and how each constant was fitted:
docs/design/adaptive-placement.md. On by default (RouterConfig.adaptive_layout_search).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import NamedTuple

from engine.slo import RequestSLO
from router.adaptive.latency_model import LatencyModel

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
