"""The cluster's layout for the traffic of the last window: how many of the adaptive instances
should prefill only (k), the others decoding only, or none (k = 0: every request chooses its
own placement, router/adaptive.py). DistServe's placement search, online, over what arrived.

Why the cluster needs it on top of the per-request choice: what a split buys is that the
decode instances see no prompts at all. One request placed remote does not buy that, while the
other requests keep prefilling beside its decode; so a placer that decides one request at a
time goes to the split only after the TPOT tail has crossed, and then half-way (measured on
chatbot at 2.07 req/s per core: 18 requests split and met their SLOs, 29 stayed local on the
prefilling instance, predicted and measured past their TPOT SLO).

For the window's arrivals (rate lambda, each with its prompt n, output m and SLOs) and N
instances, a layout of k prefill instances is predicted in steady state from the latency model:

    decode instance   lambda_d = lambda / (N - k) requests per second decode on it;
                      per token: step(B) / (1 - u), where B = lambda_d * E[m] * (per token)
                      (Little's law, a fixed point) and u = the prompt compute run beside its
                      decodes, per second (lambda_d * E[prompt compute] when k = 0, else 0);
                      a split adds the hand-off's gap (transfer + half a step) over m - 1 tokens
    prefill instance  lambda_p = lambda / k (k = 0: the same instance, lambda_d); utilisation
                      rho = lambda_p * E[c]; TTFT = c + the M/G/1 wait lambda_p E[c^2] /
                      (2 (1 - rho)) [+ the transfer]

A request is at risk in a layout when its predicted TTFT or TPOT passes RISK of its SLO. The
split with the fewest requests at risk is taken over k = 0 when it puts at least SWITCH_GAIN
fewer of them at risk; the cluster goes back to k = 0 once k = 0 puts no more at risk than the
split and its worst objective is BACK_LOAD of its SLO or less. A change waits DWELL of the
window after the last one (the window's arrivals must be the new ones). The mean prediction
ignores the prefill gate, which protects tight decodes where they run: so k = 0, where the gate
works, is the default, and a split must win clearly.

Status: experimental, off (RouterConfig.adaptive_layout_search). Replayed over the arrivals of
two bench runs (benchmarks/layout_replay.py, benchmarks/results/goodput-2core/layout-replay-*),
it did not split at chatbot 1.48/core (colocated attained 0.83, disaggregated 0.97) nor in shift
where disaggregated led, and split for code at 6.0/core where colocated attained 0.97 and
disaggregated 0.87: the mean of a request's stalls is not their tail, which sets attainment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.slo import RequestSLO
from router.latency_model import LatencyModel

RISK = 0.8  # a predicted latency past this share of its SLO puts the request at risk
SWITCH_GAIN = 0.15  # a split must put this share of the window's requests fewer at risk
BACK_LOAD = 0.7  # k = 0 again when its worst objective, on average, is under this share
DWELL = 0.5  # of the window: no layout change sooner than this after the last one
MIN_ARRIVALS = 20  # a rate from fewer arrivals is noise (8 Poisson arrivals: +-35%)
MAX_UTILISATION = 0.95  # an instance busier than this is predicted to fall behind
FIXED_POINT_STEPS = 25


@dataclass(frozen=True)
class Arrival:
    at: float
    num_tokens: int
    max_tokens: int
    slo: RequestSLO


@dataclass(frozen=True)
class Forecast:
    """A layout's prediction for the window: the share of its requests at risk, and their
    mean worst objective (TTFT or TPOT over its SLO)."""

    prefill_instances: int
    at_risk: float
    load: float


class LayoutModel:
    """Keeps the window's arrivals and the layout it chose (`prefill_instances`)."""

    def __init__(self, model: LatencyModel, window_s: float) -> None:
        self.model = model
        self.window_s = window_s
        self.arrivals: deque[Arrival] = deque()
        self.prefill_instances = 0
        self.changed_at = float("-inf")
        self.last: tuple[Forecast, ...] = ()  # every layout's forecast at the last decision

    def note(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)
        while self.arrivals and self.arrivals[0].at < arrival.at - self.window_s:
            self.arrivals.popleft()

    def rate(self) -> float | None:
        """Arrivals per second over the window (None: too few to tell)."""
        if len(self.arrivals) < MIN_ARRIVALS:
            return None
        span = self.arrivals[-1].at - self.arrivals[0].at
        return (len(self.arrivals) - 1) / span if span > 0 else None

    def update(self, num_instances: int, now: float) -> int:
        """The layout for the window's traffic on `num_instances` instances (k prefill-only)."""
        if num_instances < 2:
            self.prefill_instances = 0
            return 0
        current = min(self.prefill_instances, num_instances - 1)
        rate = self.rate()
        if rate is None or now - self.changed_at < DWELL * self.window_s:
            self.prefill_instances = current
            return current
        forecasts = tuple(self.forecast(num_instances, k, rate) for k in range(num_instances))
        self.last = forecasts
        local = forecasts[0]
        split = min(forecasts[1:], key=lambda f: (f.at_risk, f.load))
        if current == 0:
            chosen = split.prefill_instances if local.at_risk - split.at_risk >= SWITCH_GAIN else 0
        elif local.at_risk <= split.at_risk and local.load <= BACK_LOAD:
            chosen = 0
        elif forecasts[current].at_risk - split.at_risk >= SWITCH_GAIN:
            chosen = split.prefill_instances
        else:
            chosen = current
        if chosen != self.prefill_instances:
            self.changed_at = now
        self.prefill_instances = chosen
        return chosen

    def forecast(self, num_instances: int, k: int, rate: float) -> Forecast:
        """Layout k's prediction for the window's arrivals at `rate` per second."""
        arrivals = self.arrivals
        model = self.model
        decode_rate = rate / (num_instances - k)
        mean_out = sum(a.max_tokens for a in arrivals) / len(arrivals)
        mean_ctx = sum(a.num_tokens + a.max_tokens / 2 for a in arrivals) / len(arrivals)
        per_token_s = model.decode_step_s(1, mean_ctx)
        beside_s = [0.0] * len(arrivals)
        by_batch: dict[int, list[float]] = {}  # the fixed point revisits a few batch sizes
        for _ in range(FIXED_POINT_STEPS):
            whole = int(round(max(1.0, decode_rate * mean_out * per_token_s)))
            if k == 0:  # prompts run beside this instance's decodes
                beside_s = by_batch.get(whole) or by_batch.setdefault(whole, [
                    model.prefill_s(a.num_tokens, whole, whole * mean_ctx) for a in arrivals
                ])  # fmt: skip
            busy = decode_rate * sum(beside_s) / len(arrivals) if k == 0 else 0.0
            if busy >= MAX_UTILISATION:
                return Forecast(k, 1.0, float("inf"))
            per_token_s = model.decode_step_s(whole, whole * mean_ctx) / (1 - busy)
        step_s = per_token_s * (1 - busy)
        if k == 0:
            compute_s, prefill_rate = beside_s, decode_rate
        else:
            compute_s, prefill_rate = [model.prefill_s(a.num_tokens) for a in arrivals], rate / k
        mean_c = sum(compute_s) / len(compute_s)
        rho = prefill_rate * mean_c
        if rho >= MAX_UTILISATION:
            return Forecast(k, 1.0, float("inf"))
        wait_s = prefill_rate * sum(c * c for c in compute_s) / len(compute_s) / (2 * (1 - rho))
        # k = 0: the gate holds a prompt while that saves a decode ending before the prompt's
        # latest start; a decode shorter than the typical prompt's wait sees no stall.
        waits = sorted(a.slo.ttft_s - wait_s - c for a, c in zip(arrivals, compute_s, strict=True))
        may_wait_s = waits[len(waits) // 2]
        at_risk = 0
        load = 0.0
        for arrival, c in zip(arrivals, compute_s, strict=True):
            transfer_s = model.transfer_s(arrival.num_tokens) if k else 0.0
            ttft_s = wait_s + c + transfer_s
            gap_s = transfer_s + step_s / 2 if k else 0.0
            protected = k == 0 and arrival.max_tokens * step_s <= may_wait_s
            tpot_s = (step_s if protected else per_token_s) + gap_s / max(1, arrival.max_tokens - 1)
            worst = max(ttft_s / arrival.slo.ttft_s, tpot_s / arrival.slo.tpot_s)
            at_risk += worst > RISK
            load += worst
        return Forecast(k, at_risk / len(arrivals), load / len(arrivals))
