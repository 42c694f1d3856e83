"""Adaptive placement: for each request, prefill where it decodes (local) or on another
instance and move the KV (remote), from predicted TTFT and TPOT against the request's own SLOs.

Every instance of an adaptive cluster (Role.ADAPTIVE) prefills, decodes, or both, and its engine
schedules by SLO (engine/slo.py, the prefill gate): a prompt chunk that would make a running
decode miss its TPOT SLO waits, decode-only steps go on, until the prompt's own TTFT SLO cannot
wait any longer. So a tight decode is protected where it runs, and what a placement costs is
the waiting it causes. For each request the router weighs every placement, local on any
instance or remote from any instance to any other (placement_model.py predicts each one's TTFT,
TPOT and the decodes it would harm).

The request takes the option that breaks the fewest objectives (its own two, and each harmed
decode), then the lowest TTFT/ttft_slo + TPOT/tpot_slo + crowding (the least loaded, relative
to what the request and the decodes it joins allow), a remote option paying REMOTE_COST for the
KV it moves. Under load this splits the roles by itself: a prompt avoids an instance whose
decodes it would break, so the instance with the most long decodes takes fewer prompts, and the
decodes placed there from elsewhere see fewer prompts run beside them.

Roles are what the placements make of the instances: `prefill_role` is the instances that
prefilled for another one within the last `window_s`, and `role_changes` is when their number
changed. Each instance's gate sets, step by step, how many prompt tokens it admits beside its
decodes; the router's share of prefill-role instances and the gates' holds both follow the
traffic, with no restart.

The latency model (latency_model.py) is the profile's step model corrected online. With `layout_search` (RouterConfig.adaptive_layout_search, on by default) the options are first
cut to the cluster's layout for the window's traffic (layout_model.py): while it is split,
prefill on its prefill-only instances and decode on the others; every request that ends feeds
it. Reasoning and evidence: docs/design/adaptive-placement.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engine.slo import RequestSLO
from router.adaptive.latency_model import LatencyModel
from router.adaptive.layout_model import Arrival, LayoutModel, Running
from router.adaptive.placement_model import Decoding, InstanceView, PlacementModel, Queued
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.policies import InstanceState

WINDOW_S = 10.0  # the placements roles follow, by default (router.adaptive_window_s)
MAX_ROLE_CHANGES = 256  # the role timeline kept for metrics and tests

__all__ = ["AdaptivePlacer", "Placement", "RequestSLO", "WINDOW_S", "adaptive_placer"]


@dataclass(frozen=True)
class Placement:
    """One request's placement and what the router predicted for it."""

    prefill_id: str
    decode_id: str  # == prefill_id when local
    predicted_ttft_s: float
    predicted_tpot_s: float
    prefill_role_instances: int  # instances that prefilled for another in the window, with it
    profiled_compute_s: float = 0.0  # the prompt's compute at the profile's speed
    decode_bias: float = 1.0  # the model's decode over prefill speed when it predicted
    predicted_handoff_s: float = 0.0  # remote: first token to second, by the model alone
    predicted_lag_s: float = 0.0  # the prefill instance's first-token lag in predicted_ttft_s
    chosen_at: float | None = None  # the placer's clock when it chose (None: when placed)

    @property
    def kind(self) -> str:
        return "local" if self.prefill_id == self.decode_id else "remote"


class AdaptivePlacer:
    """The router's per-request placement over adaptive instances (one per router; its state
    is the router's own view: placements, first tokens, token counts, ends)."""

    def __init__(
        self,
        model: LatencyModel,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = WINDOW_S,
        layout_search: bool = False,
    ) -> None:
        self.model = model
        self.window_s = window_s
        self._metrics = metrics
        self._clock = clock
        self._predict = PlacementModel(model, window_s)
        self.layout = LayoutModel(model, window_s) if layout_search else None
        self.split_prefill: tuple[str, ...] = ()  # the layout's prefill-only instances
        self._instances: dict[str, InstanceView] = {}
        self._remote_prefills: deque[tuple[float, str]] = deque()  # (at, prefill instance)
        self._learned_from: dict[str, int] = {}  # instance -> id() of the load report learned
        self._last_chosen: dict[str, float] = {}  # instance -> when a placement last used it
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
        views = {i: self._instances.setdefault(i, InstanceView()) for i in ids}
        for view in views.values():
            view.forget_before(now - self.window_s)
        chunk_size = candidates[0].load.details.chunk_size
        if chunk_size:
            self.model.chunk_size = chunk_size
        for state in candidates:
            self._learn_decode_step(state, views[state.instance_id])
        free_blocks = {state.instance_id: state.num_free_blocks_estimate for state in candidates}
        options = [
            self._predict.option(
                a, views[a], b, views[b], num_prompt_tokens, cached.get(a, 0), max_tokens, slo, now
            )
            for a, b in self._pairs(ids, views, num_prompt_tokens, max_tokens, slo, now)
        ]
        fits = [o for o in options if free_blocks.get(o.decode_id, 1) > 0] or options
        # An exact tie (an idle cluster: every instance predicts the same) goes to the instances
        # chosen longest ago, so idle traffic spreads and every engine learns its step costs.
        used = self._last_chosen
        best = min(
            fits,
            key=lambda o: (o.score(slo), used.get(o.decode_id, -1.0), used.get(o.prefill_id, -1.0)),
        )
        used[best.prefill_id] = used[best.decode_id] = now
        if best.remote:
            self._remote_prefills.append((now, best.prefill_id))
        self._update_roles(now)
        uncached = num_prompt_tokens - cached.get(best.prefill_id, 0)
        prefill = views[best.prefill_id]
        return Placement(
            best.prefill_id,
            best.decode_id,
            best.ttft_s,
            best.tpot_s,
            len(self.prefill_role),
            self.model.profiled_prefill_s(uncached, *prefill.decode_load()),
            self.model.decode_bias,
            best.handoff_s,
            best.lag_s,
            now,
        )

    def _pairs(
        self,
        ids: list[str],
        views: Mapping[str, InstanceView],
        num_prompt_tokens: int,
        max_tokens: int,
        slo: RequestSLO,
        now: float,
    ) -> list[tuple[str, str]]:
        """The (prefill, decode) pairs the cluster's layout allows (layout_model.py):
        every pair when it is not split, else prefill on a prefill-only instance and decode on
        another. The prefill-only instances stay the same while their number does; new ones
        are those with the fewest decodes."""
        every = [(a, b) for a in ids for b in ids]
        if self.layout is None:
            return every
        self.layout.note(Arrival(now, num_prompt_tokens, max_tokens, slo))
        running = (
            Running(d.placed_at, d.num_tokens, d.ttft_objective(), d.tpot_objective())
            for view in views.values()
            for d in view.decoding.values()
            if d.local and d.first_token_at is not None
        )
        k = self.layout.update(len(ids), now, running)
        if k == 0:
            self.split_prefill = ()
            return every
        kept = [i for i in self.split_prefill if i in views]
        if len(kept) != k:
            spare = sorted((i for i in ids if i not in kept), key=lambda i: len(views[i].decoding))
            kept = (kept + spare)[:k]
        self.split_prefill = tuple(sorted(kept))
        return [(a, b) for a, b in every if a in kept and b not in kept]

    def _learn_decode_step(self, state: InstanceState, view: InstanceView) -> None:
        """The decode speed learns from the step the instance's engine measures (its load
        report's `decode_step_s` at `decode_batch`): a measured TPOT would not do, since the
        gate lets prompt chunks use each decode's slack on purpose."""
        if self._learned_from.get(state.instance_id) == id(state.load):
            return  # once per report, however many arrivals read it
        self._learned_from[state.instance_id] = id(state.load)
        measured_s, batch = state.load.details.decode_step_s, state.load.details.decode_batch
        if measured_s and batch:
            contexts = [
                d.num_prompt_tokens + d.num_tokens
                for d in view.decoding.values()
                if d.first_token_at is not None
            ]
            mean_ctx = sum(contexts) / len(contexts) if contexts else 0.0
            self.model.observe_decode_step(batch, mean_ctx * batch, measured_s)

    def _update_roles(self, now: float) -> None:
        """The prefill-role instances: those that prefilled for another in the window."""
        log = self._remote_prefills
        while log and log[0][0] < now - self.window_s:
            log.popleft()
        self.prefill_role = tuple(sorted({instance_id for _, instance_id in log}))
        k = len(self.prefill_role)
        if not self.role_changes or self.role_changes[-1][1] != k:
            self.role_changes.append((now, k))

    # -- the request's life -----------------------------------------------------------------

    def placed(
        self, key: str, placement: Placement, num_prompt: int, max_tokens: int, slo: RequestSLO
    ) -> None:
        """The request is being submitted as `placement` says (router/dispatch.py counts it
        before the submission lands, so the arrivals meanwhile see it; `release` takes it back
        if it does not land). Its TTFT counts from the choice, as the prediction did: the
        submission waits for the instances to take it (between their steps, under load), and a
        TTFT counted from there is short by that wait, and the layout search, reading it, would
        see more TTFT room than the clients do and split where it should not."""
        now = self._clock() if placement.chosen_at is None else placement.chosen_at
        prefill = self._instances.setdefault(placement.prefill_id, InstanceView())
        decode = self._instances.setdefault(placement.decode_id, InstanceView())
        compute_s = self.model.speed * placement.profiled_compute_s
        model_ttft_s = placement.predicted_ttft_s - placement.predicted_lag_s
        prefill.queued[key] = Queued(
            compute_s, now + slo.ttft_s, now, model_ttft_s, remote=placement.kind == "remote"
        )
        prefill.note_prompt(now, compute_s, slo.ttft_s - compute_s)
        decode.decoding[key] = Decoding(
            num_prompt,
            max_tokens,
            slo.tpot_s,
            placed_at=now,
            ttft_slo_s=slo.ttft_s,
            local=placement.kind == "local",
        )
        if self._metrics is not None:
            self._metrics.observe_placement(
                placement.kind,
                placement.predicted_ttft_s,
                placement.predicted_tpot_s,
                placement.prefill_role_instances,
                self.model.speed,
            )

    def prefilled(self, key: str, placement: Placement, measured_s: float | None) -> None:
        """The first token is in (`measured_s`: the worker's prefill compute, when told)."""
        prefill = self._instances.get(placement.prefill_id)
        if prefill is not None and (queued := prefill.queued.pop(key, None)) is not None:
            prefill.note_first_token(queued, self._clock())
        decode = self._instances.get(placement.decode_id)
        if decode is not None and (decoding := decode.decoding.get(key)) is not None:
            decoding.first_token_at = self._clock()
            decode.note_tokens(decoding, 1, decoding.first_token_at)
        if measured_s is not None:
            self.model.observe(placement.profiled_compute_s, measured_s)

    def progress(self, key: str, placement: Placement, num_tokens: int) -> None:
        """The request has `num_tokens` tokens out. A remote one's second token measures its
        hand-off: the time since its first, which the model's gap learns from."""
        decode = self._instances.get(placement.decode_id)
        if decode is None or (decoding := decode.decoding.get(key)) is None:
            return
        now = self._clock()
        first_at = decoding.first_token_at
        if (
            placement.kind == "remote"
            and first_at is not None
            and decoding.num_tokens < 2
            and num_tokens == 2
        ):
            self._predict.observe_handoff(placement.predicted_handoff_s, now - first_at, now)
        decode.note_tokens(decoding, num_tokens, now)

    def release(self, key: str, placement: Placement) -> None:
        """The request ended (or was placed again): forget it on both instances. Its
        worst objective tells the layout search how the layout it ran in does."""
        decode = self._instances.get(placement.decode_id)
        decoding = decode.decoding.get(key) if decode is not None else None
        if self.layout is not None and decoding is not None and decoding.first_token_at is not None:
            self.layout.note_ended(
                self._clock(),
                placement.kind == "local",
                decoding.placed_at,
                decoding.ttft_objective(),
                decoding.tpot_objective(),
            )
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
    return AdaptivePlacer(
        model,
        metrics,
        window_s=config.adaptive_window_s,
        layout_search=config.adaptive_layout_search,
    )
