"""Adaptive placement: for each request, prefill where it runs (local) or on another instance
and move the KV (remote), from predicted TTFT and TPOT against the request's own SLOs.

Every instance of an adaptive cluster (Role.ADAPTIVE) prefills, decodes, or does both. Two
decisions, one slow and one per request:

Roles (`_update_roles`, at each placement, over the last `window_s` of arrivals). A request is
*tight* when its TPOT SLO cannot absorb the stalls a colocated instance puts on its decodes:
its slack over `max_tokens` tokens, (tpot_slo - decode step) x (max_tokens - 1), is below
`STALLS_ABSORBED` of the window's long prefills (their 90th percentile of predicted compute).
While tight requests make up `TIGHT_SHARE` of the window, `k` instances take remote prefills
(enough to keep each under `PREFILL_UTILIZATION` of prefill work, at least 1, at most n - 1);
the rest decode; unless queueing the tight prompts on k instances would break more of their
TTFT SLOs than it keeps (`_split_breaks_ttft`). With none in the window, k = 0: every request runs where it is prefilled,
the colocated layout. So summarization-like traffic (long prompts, tight TPOT) turns the cluster
into prefill + decode instances, chatbot-like traffic (short prompts, long loose outputs) into
replicas, and a shift between them moves the roles within one window, with no restart.

Placement (`choose`), given the roles. The options are: local on any instance; remote from a
prefill-role instance to a decode-role one (only while k > 0). For each the model predicts

    TTFT  = queued prefill compute there + this prompt's compute (the tokens its prefix cache
            lacks, when KV-aware routing's index is on; its chunks, each riding a step with that
            instance's decodes) [+ the KV transfer]
    TPOT  = the decode instance's step with this request added / (1 - its prefill share),
            the share of the last window's time it spent computing prompts
    harm  = decodes on the prefill instance whose slack (the time left before their TPOT SLO
            breaks, less the steps they still need) the queued and new prefill would use up

An option is feasible when TTFT and TPOT meet the request's SLOs and it harms no decode (one
already late does not count). The request takes the option that breaks the fewest objectives
(its own two, and each harmed decode), local before remote among equals (no KV moves, and a
prefill-role instance stays free for the prompts that need it), then the lowest
TTFT/ttft_slo + TPOT/tpot_slo (the least loaded, relative to what the request allows). While
roles are on, a tight request is always prefilled on a prefill-role instance and decoded on
another: the decode-role instances admit local prefills only of loose requests, and only as
much prompt compute as their decodes' slack allows (the per-request form of a per-step prefill
budget, which on CPU costs more than it saves: small chunks run the prompt 1.7x slower).

Model (router/latency_model.py): the planner's latency model (planner/latency.StepModel, from
the profile file) times a speed factor the router learns from every first token (the worker's
measured prefill compute over the predicted one, an exponential average): a profile taken on
another day, or a machine whose speed moved, still predicts in the right units. A second
factor, learned from every finished request's TPOT against its prediction, scales the decode
step: what the profile's step and the stall model miss under load (measured on the bench: TPOT
predicted 16-27 ms came out 30-38 ms, and the SLO between them let placements through that
broke it).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from router.config import RouterConfig
from router.latency_model import LatencyModel
from router.metrics import RouterMetrics
from router.policies import InstanceState

WINDOW_S = 10.0  # the arrivals the roles follow, by default (router.adaptive_window_s)
STALLS_ABSORBED = 2.0  # a request that absorbs fewer long prefills than this is tight
TIGHT_SHARE = 0.05  # tight requests' share of the window that turns on prefill roles
PREFILL_UTILIZATION = 0.8  # the prefill work one prefill-role instance is given at most
MAX_ROLE_CHANGES = 256  # the role timeline kept for metrics and tests


@dataclass(frozen=True)
class RequestSLO:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Placement:
    """One request's placement and what the router predicted for it."""

    prefill_id: str
    decode_id: str  # == prefill_id when local
    predicted_ttft_s: float
    predicted_tpot_s: float
    prefill_role_instances: int  # k at the time
    profiled_compute_s: float = 0.0  # the prompt's compute at the profile's speed
    decode_bias: float = 1.0  # the model's decode bias when it predicted predicted_tpot_s

    @property
    def kind(self) -> str:
        return "local" if self.prefill_id == self.decode_id else "remote"


@dataclass
class _Decoding:
    """A request decoding (or about to) on an instance, as far as its slack goes."""

    num_prompt_tokens: int
    max_tokens: int
    tpot_slo_s: float
    first_token_at: float | None = None  # time.monotonic()
    num_tokens: int = 0


@dataclass
class _Instance:
    queued: dict[str, float] = field(default_factory=dict)  # key -> predicted compute s
    decoding: dict[str, _Decoding] = field(default_factory=dict)
    prefill_log: deque[tuple[float, float]] = field(default_factory=deque)  # (at, compute s)


@dataclass(frozen=True)
class _Arrival:
    at: float
    compute_s: float
    ttft_slo_s: float
    slack_s: float  # (tpot_slo - decode step) x (max_tokens - 1)


@dataclass(frozen=True)
class _Option:
    prefill_id: str
    decode_id: str
    ttft_s: float
    tpot_s: float
    harm: int

    def score(self, slo: RequestSLO) -> tuple[int, bool, float]:
        """Objectives broken, then local first (no KV moves), then the load it adds."""
        misses = self.harm + int(self.ttft_s > slo.ttft_s) + int(self.tpot_s > slo.tpot_s)
        remote = self.prefill_id != self.decode_id
        return misses, remote, self.ttft_s / slo.ttft_s + self.tpot_s / slo.tpot_s


class AdaptivePlacer:
    """The router's per-request placement over adaptive instances (one per router; its state
    is the router's own view: placements, first tokens, token counts, ends)."""

    def __init__(
        self,
        model: LatencyModel,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = WINDOW_S,
    ) -> None:
        self.model = model
        self.window_s = window_s
        self._metrics = metrics
        self._clock = clock
        self._instances: dict[str, _Instance] = {}
        self._arrivals: deque[_Arrival] = deque()
        self.prefill_role: tuple[str, ...] = ()
        self.role_changes: deque[tuple[float, int]] = deque(maxlen=MAX_ROLE_CHANGES)

    # -- the decision -----------------------------------------------------------------------

    def choose(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        slo: RequestSLO,
        candidates: Sequence[InstanceState],
        num_cached: Mapping[str, int] | None = None,
    ) -> Placement:
        """Where to prefill and decode a request (`candidates`: the healthy instances, not
        empty). `num_cached`: the prompt tokens each instance's prefix cache holds (KV-aware
        routing's index), which a prefill there does not compute."""
        cached = num_cached or {}
        now = self._clock()
        ids = sorted(state.instance_id for state in candidates)
        for instance_id in ids:
            self._instances.setdefault(instance_id, _Instance())
        free_blocks = {state.instance_id: state.num_free_blocks_estimate for state in candidates}
        chunk_size = candidates[0].load.extra.get("chunk_size")
        if chunk_size:
            self.model.chunk_size = int(chunk_size)
        compute_s = self.model.prefill_s(num_prompt_tokens - max(cached.values(), default=0))
        step_s = self._mean_step_s(ids)
        arrival = _Arrival(now, compute_s, slo.ttft_s, (slo.tpot_s - step_s) * (max_tokens - 1))
        self._arrivals.append(arrival)
        long_prefill_s = self._update_roles(now, ids)
        tight = arrival.slack_s < STALLS_ABSORBED * long_prefill_s
        roles_on = bool(self.prefill_role)
        options = [
            self._option(a, b, num_prompt_tokens, cached.get(a, 0), now)
            for a in ids for b in ids
            if (a == b and not (tight and roles_on))
            or (a in self.prefill_role and b not in self.prefill_role)
        ]  # fmt: skip
        fits = [o for o in options if free_blocks.get(o.decode_id, 1) > 0] or options
        best = min(fits, key=lambda o: o.score(slo))
        state = self._instances[best.prefill_id]
        uncached = num_prompt_tokens - cached.get(best.prefill_id, 0)
        return Placement(
            best.prefill_id, best.decode_id, best.ttft_s, best.tpot_s, len(self.prefill_role),
            self.model.profiled_prefill_s(uncached, *self._decode_load(state, now)),
            self.model.decode_bias,
        )  # fmt: skip

    def _option(
        self, prefill_id: str, decode_id: str, num_tokens: int, num_cached: int, now: float
    ) -> _Option:
        prefill, decode = self._instances[prefill_id], self._instances[decode_id]
        own_s = self.model.prefill_s(num_tokens - num_cached, *self._decode_load(prefill, now))
        queued_s = sum(prefill.queued.values())
        ttft_s = queued_s + own_s
        if prefill_id != decode_id:
            ttft_s += self.model.transfer_s(num_tokens)
        batch, sum_ctx = self._decode_load(decode, now)
        step_s = self.model.decode_step_s(batch + 1, sum_ctx + num_tokens)
        slower_s = step_s - self.model.decode_step_s(batch, sum_ctx)  # each step, with it added
        share = min(self._prefill_share(decode, now, extra_s=own_s if decode is prefill else 0.0),
                    0.95)  # fmt: skip
        tpot_s = step_s / (1.0 - share)
        harm = sum(  # decodes this prefill would make late (not those late already)
            1 for d in prefill.decoding.values()
            if 0 <= self._slack_s(d, prefill, now) < queued_s + own_s
        )  # fmt: skip
        if decode is not prefill:  # and those its decode would slow past their SLO
            harm += sum(
                1 for d in decode.decoding.values()
                if 0 <= self._slack_s(d, decode, now) < slower_s * self._remaining(d)
            )  # fmt: skip
        return _Option(prefill_id, decode_id, ttft_s, tpot_s, harm)

    @staticmethod
    def _remaining(decoding: _Decoding) -> int:
        return max(0, decoding.max_tokens - max(decoding.num_tokens, 1))

    # -- roles ------------------------------------------------------------------------------

    def _update_roles(self, now: float, ids: list[str]) -> float:
        """Set the roles from the window; returns its long prefill (what tightness reads)."""
        while self._arrivals and self._arrivals[0].at < now - self.window_s:
            self._arrivals.popleft()
        long_prefill_s = self._long_prefill_s()  # once: the window may hold many arrivals
        bound_s = STALLS_ABSORBED * long_prefill_s
        tight = [arrival for arrival in self._arrivals if arrival.slack_s < bound_s]
        k = 0
        if len(tight) >= max(1.0, TIGHT_SHARE * len(self._arrivals)) and len(ids) > 1:
            work_s = sum(arrival.compute_s for arrival in self._arrivals)
            needed = math.ceil(work_s / self.window_s / PREFILL_UTILIZATION)
            k = min(max(needed, 1), len(ids) - 1)
            if self._split_breaks_ttft(tight, k):
                k = 0
        kept = [i for i in self.prefill_role if i in ids][:k]
        # New prefill-role instances: those with the fewest decodes to protect.
        for instance_id in sorted(ids, key=lambda i: (len(self._instances[i].decoding), i)):
            if len(kept) >= k:
                break
            if instance_id not in kept:
                kept.append(instance_id)
        self.prefill_role = tuple(sorted(kept))
        if not self.role_changes or self.role_changes[-1][1] != k:
            self.role_changes.append((now, k))
        return long_prefill_s

    def _split_breaks_ttft(self, tight: list[_Arrival], k: int) -> bool:
        """Whether queueing the tight requests' prompts on k instances would make more of them
        miss their TTFT than it saves from colocated stalls: the mean wait of an M/D/1 queue at
        those instances' prompt utilization, against each one's TTFT SLO. (Code completion's
        TTFT is 2.5 prefills: under load, one prefill instance's queue breaks it; summarization
        allows 10.)"""
        mean_s = sum(arrival.compute_s for arrival in tight) / len(tight)
        # over the time they arrived in (the window, or less when it has not filled yet)
        span_s = max(self._clock() - self._arrivals[0].at, mean_s, 1e-3)
        utilization = min(0.95, mean_s * len(tight) / min(span_s, self.window_s) / k)
        wait_s = utilization / (2.0 * (1.0 - utilization)) * mean_s
        late = sum(1 for arrival in tight if arrival.compute_s + wait_s > arrival.ttft_slo_s)
        return late > len(tight) - late

    def _long_prefill_s(self) -> float:
        """The 90th percentile of the window's predicted prompt computes."""
        computes = sorted(arrival.compute_s for arrival in self._arrivals)
        if not computes:
            return 0.0
        return computes[min(len(computes) - 1, int(0.9 * len(computes)))]

    # -- live state -------------------------------------------------------------------------

    def _decode_load(self, instance: _Instance, now: float) -> tuple[int, float]:
        """(batch, sum of contexts) of the requests decoding there."""
        batch = len(instance.decoding)
        sum_ctx = sum(d.num_prompt_tokens + d.num_tokens for d in instance.decoding.values())
        return batch, float(sum_ctx)

    def _mean_step_s(self, ids: list[str]) -> float:
        """A decode step as the instances run them now (one sequence of no context, idle)."""
        steps = [
            self.model.decode_step_s(*self._decode_load(self._instances[i], 0.0)) for i in ids
        ]
        return max(self.model.decode_step_s(1, 0.0), sum(steps) / max(1, len(steps)))

    def _prefill_share(self, instance: _Instance, now: float, extra_s: float = 0.0) -> float:
        """The share of the last window the instance spent (or is set to spend) on prompts."""
        log = instance.prefill_log
        while log and log[0][0] < now - self.window_s:
            log.popleft()
        return (sum(compute_s for _, compute_s in log) + extra_s) / self.window_s

    def _slack_s(self, decoding: _Decoding, instance: _Instance, now: float) -> float:
        """How long the decode may still be stalled before its TPOT breaks its SLO."""
        step_s = self.model.decode_step_s(*self._decode_load(instance, now))
        if decoding.first_token_at is None:  # not decoding yet: its whole budget is ahead
            return (decoding.tpot_slo_s - step_s) * max(0, decoding.max_tokens - 1)
        deadline = decoding.first_token_at + decoding.tpot_slo_s * (decoding.max_tokens - 1)
        return deadline - now - self._remaining(decoding) * step_s

    # -- the request's life -----------------------------------------------------------------

    def placed(self, key: str, placement: Placement, num_prompt: int, max_tokens: int,
               slo: RequestSLO) -> None:  # fmt: skip
        now = self._clock()
        prefill = self._instances.setdefault(placement.prefill_id, _Instance())
        decode = self._instances.setdefault(placement.decode_id, _Instance())
        compute_s = self.model.speed * placement.profiled_compute_s
        prefill.queued[key] = compute_s
        prefill.prefill_log.append((now, compute_s))
        decode.decoding[key] = _Decoding(num_prompt, max_tokens, slo.tpot_s)
        if self._metrics is not None:
            self._metrics.observe_placement(
                placement.kind, placement.predicted_ttft_s, placement.predicted_tpot_s,
                placement.prefill_role_instances, self.model.speed,
            )  # fmt: skip

    def prefilled(self, key: str, placement: Placement, measured_s: float | None) -> None:
        """The first token is in (`measured_s`: the worker's prefill compute, when told)."""
        prefill = self._instances.get(placement.prefill_id)
        if prefill is not None:
            prefill.queued.pop(key, None)
        decode = self._instances.get(placement.decode_id)
        decoding = None if decode is None else decode.decoding.get(key)
        if decoding is not None:
            decoding.first_token_at = self._clock()
            decoding.num_tokens = max(decoding.num_tokens, 1)
        if measured_s is not None:
            self.model.observe(placement.profiled_compute_s, measured_s)

    def finished(self, placement: Placement, tpot_s: float) -> None:
        """The request ended with this TPOT (measured by the router): the TPOT predictions learn
        from it."""
        self.model.observe_tpot(placement.predicted_tpot_s, placement.decode_bias, tpot_s)

    def progress(self, key: str, placement: Placement, num_tokens: int) -> None:
        decode = self._instances.get(placement.decode_id)
        decoding = None if decode is None else decode.decoding.get(key)
        if decoding is not None:
            decoding.num_tokens = num_tokens

    def release(self, key: str, placement: Placement) -> None:
        """The request ended (or was placed again): forget it on both instances."""
        for instance_id in (placement.prefill_id, placement.decode_id):
            instance = self._instances.get(instance_id)
            if instance is not None:
                instance.queued.pop(key, None)
                instance.decoding.pop(key, None)

    def num_tracked(self) -> int:
        """Requests the placer still counts somewhere (0 once every request has ended)."""
        return sum(len(i.queued) + len(i.decoding) for i in self._instances.values())


def adaptive_placer(config: RouterConfig, metrics: RouterMetrics | None = None) -> AdaptivePlacer:
    """The placer of an adaptive cluster's router, from `config.latency_profile`."""
    if config.latency_profile is None:
        raise ValueError(
            "an adaptive cluster predicts with a latency profile: set router.latency_profile "
            "to a file `pdserve profile` wrote for this model and device"
        )
    model = LatencyModel.from_file(config.latency_profile, config.latency_profile_model)
    return AdaptivePlacer(model, metrics, window_s=config.adaptive_window_s)
