"""Placing a request on workers: pick instances with the policies, reserve KV, submit the prompt.

    disaggregated:  decode = decode_policy(...);  ticket = decode.reserve(req)
                    prefill = prefill_policy(...); prefill.submit(req, ticket)
    colocated:      prefill = prefill_policy(...); prefill.submit(req, None)
    adaptive:       (A, B) = placer.choose(...)  (router/adaptive/placer.py)
                    A == B: A.submit(req, None)       else: as disaggregated, A for B

An instance that answers Overloaded (or fails, or times out) is left out and the policy picks
again among the rest; a refused prefill gives back the decode reservation first. When no
candidate is left the request fails: RESOURCE_EXHAUSTED if some instance was merely full,
UNAVAILABLE if none could be reached, unless an instance comes back (a restarted worker)
before `wait_until`: then every instance is a candidate again. Each instance is added to the request's holders before
it is called, so an abort reaches it even when the call times out halfway.

Each placement has a worker-side id of its own (WorkerPool.new_placement). A call that timed out
may still land: the instance then runs a placement the router gave up on, under an id no stream
listens to, and the aborts sent now and at the request's end free it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass

from router.adaptive import AdaptivePlacer, Placement, RequestSLO
from router.generation_errors import FailureKind, GenerationFailed
from router.policies import DecodePolicy, KVAware, PrefillPolicy
from router.validation import ValidatedRequest
from router.worker_api import KVTicket, Overloaded, RequestTimings, WorkerRequest
from router.worker_pool import RequestChannel, WorkerPool


@dataclass(frozen=True)
class Dispatch:
    prefill_id: str
    decode_id: str | None  # None when colocated (or an adaptive request placed local)
    num_prompt_tokens: int  # those the prefill instance computes (a cached prefix excepted)
    num_failed: int = 0  # placements that failed on the way (not merely full): retries
    placement: Placement | None = None  # an adaptive cluster's decision
    key: str = ""  # the placement's worker-side request id


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        worker_timeout_s: float,
        placer: AdaptivePlacer | None = None,
        default_slo: RequestSLO | None = None,
    ) -> None:
        self._pool = pool
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._timeout_s = worker_timeout_s
        if pool.adaptive and (placer is None or default_slo is None):
            raise ValueError("an adaptive pool needs a placer and default SLOs")
        self.placer = placer if pool.adaptive else None
        self._default_slo = default_slo or RequestSLO(1.0, 1.0)

    async def dispatch(
        self,
        request: ValidatedRequest,
        channel: RequestChannel,
        arrival_time: float,
        wait_until: float = 0.0,
        avoid: Collection[str] = (),
    ) -> Dispatch:
        """Place the request. `avoid`: instances that just failed it, tried only when no other
        is left; `wait_until` (time.monotonic()): how long to wait for an instance to come back
        when none is left to try."""
        refused: set[str] = set()
        avoiding = set(avoid)
        num_overloaded = num_failed = 0
        mark = self._pool.recovery_mark()
        while True:
            placement = self._choose(request, refused | avoiding)
            prefill_id: str | None
            decode_id: str | None = None
            if placement is not None:
                prefill_id = placement.prefill_id
                if placement.kind == "remote":
                    decode_id = placement.decode_id
            else:
                decode_id = self._pick_decode(request, refused | avoiding)
                prefill_id = self._pick_prefill(request, refused | avoiding)
            if prefill_id is None or (self._pool.disaggregated and decode_id is None):
                placement = None
                if avoiding:
                    avoiding.clear()
                    continue
                if num_overloaded or not await self._pool.wait_for_recovery(
                    mark, wait_until - time.monotonic()
                ):
                    raise self._no_candidate_left(num_overloaded, len(refused))
                refused.clear()
                mark = self._pool.recovery_mark()
                continue
            worker_request = WorkerRequest(
                self._pool.new_placement(channel),
                request.prompt_token_ids,
                request.params,
                arrival_time,
                prefill_instance=prefill_id,
                decode_instance=decode_id or "",
                slo=request.slo or (self._default_slo if self.placer is not None else None),
            )
            key = worker_request.request_id
            num_tokens = self._note_placed(request, key, prefill_id, decode_id, placement)
            try:
                failed_id, overloaded = await self._place(
                    worker_request, channel, prefill_id, decode_id
                )
            except BaseException:  # cancelled (the client went away): the caller aborts it
                self._unnote_placed(key, prefill_id, decode_id, placement, num_tokens)
                raise
            if failed_id is None:
                return Dispatch(prefill_id, decode_id, num_tokens, num_failed, placement, key)
            self._unnote_placed(key, prefill_id, decode_id, placement, num_tokens)
            refused.add(failed_id)
            num_overloaded += int(overloaded)
            num_failed += int(not overloaded)
            self._abandon(channel)

    def _note_placed(
        self,
        request: ValidatedRequest,
        key: str,
        prefill_id: str,
        decode_id: str | None,
        placement: Placement | None,
    ) -> int:
        """Count the placement on its instances before its submission is awaited (returns the
        prompt tokens the prefill instance computes). The submission waits for the instances
        to be between steps, and the arrivals meanwhile must see it: counted only once it had
        landed, a burst's arrivals each saw the queue without the others' prompts and piled
        onto one instance, each predicted well inside its TTFT SLO and each taking past it
        (docs/design/adaptive-placement.md)."""
        prompt = request.prompt_token_ids
        num_tokens = self._prefill_policy.placed(prompt, prefill_id)
        self._pool.note_dispatch(prefill_id, num_tokens, is_prefill=True)
        if decode_id is not None:
            self._pool.note_dispatch(decode_id, len(prompt), is_prefill=False)
        if placement is not None and self.placer is not None:
            slo = request.slo or self._default_slo
            self.placer.placed(key, placement, len(prompt), request.params.max_tokens, slo)
        return num_tokens

    def _unnote_placed(
        self,
        key: str,
        prefill_id: str,
        decode_id: str | None,
        placement: Placement | None,
        num_tokens: int,
    ) -> None:
        """Take back `_note_placed` for a placement that did not land."""
        self._pool.note_prefilled(prefill_id, num_tokens)
        self._pool.note_done(prefill_id)
        if decode_id is not None:
            self._pool.note_done(decode_id)
        if placement is not None and self.placer is not None:
            self.placer.release(key, placement)

    def prefilled(self, dispatch: Dispatch, timings: RequestTimings | None = None) -> None:
        """The request's first token is in: its prompt no longer waits on the prefill instance
        (the policies read that instance's outstanding prompt tokens as its queue). `timings`:
        the first token's, whose prefill compute tunes the adaptive placer's model."""
        self._pool.note_prefilled(dispatch.prefill_id, dispatch.num_prompt_tokens)
        if self.placer is not None and dispatch.placement is not None:
            measured = timings.prefill_s if timings is not None and timings.prefill_s else None
            self.placer.prefilled(dispatch.key, dispatch.placement, measured)

    def progress(self, dispatch: Dispatch, num_tokens: int) -> None:
        """The request has `num_tokens` tokens out (the adaptive placer's slack reads it)."""
        if self.placer is not None and dispatch.placement is not None:
            self.placer.progress(dispatch.key, dispatch.placement, num_tokens)

    def release(self, dispatch: Dispatch, prefilled: bool) -> None:
        """Undo the dispatch's bookkeeping when the request ends (`prefilled`: `prefilled`
        was called for it)."""
        if self.placer is not None and dispatch.placement is not None:
            self.placer.release(dispatch.key, dispatch.placement)
        if not prefilled:
            self._pool.note_prefilled(dispatch.prefill_id, dispatch.num_prompt_tokens)
        self._pool.note_done(dispatch.prefill_id)
        if dispatch.decode_id is not None:
            self._pool.note_done(dispatch.decode_id)

    def abandon(self, channel: RequestChannel, keep: str | None = None) -> None:
        """Give up on the channel's current placement (a recovered request): abort it on every
        holder but `keep` (the one that ended it and freed its state itself)."""
        channel.holder_ids.discard(keep or "")
        self._abandon(channel)

    def _abandon(self, channel: RequestChannel) -> None:
        """Give up on the current placement: abort it wherever it may have landed, now and
        again when the request ends (a timed-out submit may land after this abort)."""
        self._pool.abort_everywhere(channel.request_id, channel.holder_ids)
        channel.abandoned.append((channel.request_id, set(channel.holder_ids)))
        channel.holder_ids.clear()

    def _choose(self, request: ValidatedRequest, refused: set[str]) -> Placement | None:
        """An adaptive cluster's placement among the instances not refused (None: not
        adaptive, or none left)."""
        if self.placer is None:
            return None
        candidates = self._pool.prefill_candidates(exclude=refused)
        if not candidates:
            return None
        prompt, max_tokens = request.prompt_token_ids, request.params.max_tokens
        slo = request.slo or self._default_slo
        cached = None
        if isinstance(self._prefill_policy, KVAware):  # the prefix index is on: use it
            cached = self._prefill_policy.cached_tokens(
                prompt, [state.instance_id for state in candidates]
            )
        return self.placer.choose(len(prompt), max_tokens, slo, candidates, cached)

    def _pick_decode(self, request: ValidatedRequest, refused: set[str]) -> str | None:
        if not self._pool.disaggregated:
            return None
        candidates = self._pool.decode_candidates(exclude=refused)
        if not candidates:
            return None
        prompt, max_tokens = request.prompt_token_ids, request.params.max_tokens
        return self._decode_policy.select(prompt, candidates, max_tokens).instance_id

    def _pick_prefill(self, request: ValidatedRequest, refused: set[str]) -> str | None:
        candidates = self._pool.prefill_candidates(exclude=refused)
        if not candidates:
            return None
        prompt, max_tokens = request.prompt_token_ids, request.params.max_tokens
        return self._prefill_policy.select(prompt, candidates, max_tokens).instance_id

    async def _place(
        self,
        request: WorkerRequest,
        channel: RequestChannel,
        prefill_id: str,
        decode_id: str | None,
    ) -> tuple[str | None, bool]:
        """Reserve and submit; returns (the instance that refused or failed, was it Overloaded)."""
        ticket: KVTicket | None = None
        if decode_id is not None:
            channel.holder_ids.add(decode_id)
            decode = self._pool.decode_handle(decode_id)
            try:
                ticket = await asyncio.wait_for(decode.reserve(request), self._timeout_s)
            except Exception as exc:
                return decode_id, isinstance(exc, Overloaded)
        channel.holder_ids.add(prefill_id)
        prefill = self._pool.prefill_handle(prefill_id)
        try:
            await asyncio.wait_for(prefill.submit(request, ticket), self._timeout_s)
        except Exception as exc:
            return prefill_id, isinstance(exc, Overloaded)
        return None, False

    def _no_candidate_left(self, num_overloaded: int, num_refused: int) -> GenerationFailed:
        if num_overloaded > 0:
            return GenerationFailed(
                FailureKind.OVERLOADED,
                f"every worker that could take the request is full ({num_overloaded} refused "
                "it as overloaded); retry later",
            )
        return GenerationFailed(
            FailureKind.UNAVAILABLE,
            f"no healthy worker can take the request ({num_refused} failed to answer); retry later",
        )
