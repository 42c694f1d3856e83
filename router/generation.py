"""One request's life in the router: admit, dispatch, stream, and clean up on every path.

    admit (bounded queue) -> pick decode + prefill (policies) -> reserve KV on decode
      (every instance full: park in a queue place until a request ends, and place again)
      -> submit to prefill -> events: first token (prefill), then the rest (decode)
      -> detokenize, cut at stop strings -> chunks to the servicer

Workers know the request by its channel's id, unique to this attempt and placement; the client's
request_id appears only in what goes back to the client (two attempts may share it). Only the
chosen instances speak for the request: an event from another one, or an error or loss of an
instance that no longer holds anything for it (the prefill once the decode instance is decoding),
is dropped.
When an instance the request runs on is lost, the request is placed again (router/recovery.py):
retried before its first token, migrated after it; the client's stream goes on.
Whatever ends the request (finish, stop string, client cancel or deadline, error), `finally`
frees its admission slot and tells every instance that may hold state for it to abort, except
the one whose finish event ended it (that one freed its state itself). gRPC stays out of this
file: failures are `GenerationFailed` with a kind the servicer maps to a status code.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.outputs import TokenLogprob
from router.adaptive import Placement
from router.admission import AdmissionController, AdmissionFull, AdmissionTicket
from router.detokenizer import IncrementalDetokenizer
from router.dispatch import Dispatch, Dispatcher
from router.generation_errors import FailureKind, GenerationFailed
from router.metrics import RouterMetrics
from router.progress import Progress, is_stale
from router.recovery import Recovery, continuation
from router.stop_strings import StopStringMatcher
from router.timings import RouterClock, RouterTimings, merge_timings, request_timings
from router.tokenizer import RouterTokenizer
from router.validation import ValidatedRequest
from router.worker_api import TokenEvent
from router.worker_pool import InstanceLost, RequestChannel, WorkerPool

# How long a request parked for KV space waits before it tries again though no request ended:
# a worker frees space on its own too (a preempted or aborted sequence, a finished transfer).
_SPACE_RETRY_S = 0.5


@dataclass(frozen=True)
class GenerationChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last chunk only
    stop_reason: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_spec_proposed_tokens: int = 0  # speculative decoding: proposed, accepted (last chunk)
    num_spec_accepted_tokens: int = 0
    timings: RouterTimings | None = None  # on the last chunk
    prefill_instance: str = ""  # on the last chunk: where the request ran
    decode_instance: str = ""
    placement: Placement | None = None  # on the last chunk, from an adaptive cluster
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first chunk, when asked for
    index: int = 0  # which of the request's n completions (router/fanout.py)


class GenerationRunner:
    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        admission: AdmissionController,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
        max_retries: int = 0,
        recovery_wait_s: float = 0.0,
    ) -> None:
        self._pool = pool
        self._dispatcher = dispatcher
        self._admission = admission
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._max_retries = max_retries
        self._recovery_wait_s = recovery_wait_s

    async def generate(
        self, request: ValidatedRequest, deadline_s: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks of new tokens and text; the last has finish_reason. Raises GenerationFailed.
        `deadline_s`: the time the client has left, if it set a deadline (admission refuses a
        request that would spend it all in the queue)."""
        accepted_at = time.perf_counter()
        deadline_at = None if deadline_s is None else time.monotonic() + deadline_s
        progress = Progress(
            IncrementalDetokenizer(self._tokenizer),
            StopStringMatcher(request.stop_strings),
            Recovery(self._max_retries, deadline_at),
            accepted_at=accepted_at,
        )
        try:
            ticket = self._admission.try_admit(deadline_s)
        except AdmissionFull as exc:
            raise GenerationFailed(FailureKind.OVERLOADED, str(exc)) from exc
        channel = self._pool.open_channel(request.request_id)
        self._update_queue_gauges()
        dispatch = None
        try:
            await self._admission.wait_until_running(ticket)
            progress.dispatched_at = time.perf_counter()
            self._update_queue_gauges()
            self._metrics.request_queue_time.observe(progress.dispatched_at - progress.accepted_at)
            self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
            arrival_time, placed, avoid = time.time(), request, ""
            lost: GenerationFailed | None = None  # the failure being recovered from
            while True:
                wait_until = progress.recovery.wait_until(self._recovery_wait_s)
                avoiding = (avoid,) if avoid else ()
                space = self._pool.space_mark()
                try:
                    dispatch = await self._dispatcher.dispatch(
                        placed, channel, arrival_time, wait_until, avoiding
                    )
                except GenerationFailed as exc:
                    if progress.recovery.deadline_passed():  # it waited for a worker: too long
                        message = (
                            f"the deadline passed while the request waited for a worker: {exc}"
                        )
                        raise GenerationFailed(FailureKind.DEADLINE, message) from exc
                    if exc.kind is FailureKind.OVERLOADED and await self._wait_for_space(
                        ticket, progress, space, len(placed.prompt_token_ids)
                    ):
                        continue
                    raise _after(lost, exc) from exc
                progress.start_placement(dispatch)
                self._admission.settle(ticket)  # a queue place kept since a park is free
                if dispatch.num_failed:  # placements that failed before this one answered
                    progress.recovery.retries += dispatch.num_failed
                    self._metrics.request_retries.inc(dispatch.num_failed)
                try:
                    async for chunk in self._stream(request, channel, progress, dispatch):
                        yield chunk
                    return
                except GenerationFailed as failure:
                    self._recover(failure, progress)
                    avoid, lost = failure.lost_instance, failure
                self._dispatcher.release(dispatch, prefilled=progress.prefilled)
                dispatch = None
                self._dispatcher.abandon(channel, keep=progress.finished_by)
                placed = continuation(request, progress.sent_token_ids)
        finally:
            self._pool.close_channel(channel)
            self._admission.release(ticket)
            self._update_queue_gauges()
            if dispatch is not None:
                self._dispatcher.release(dispatch, prefilled=progress.prefilled)
            self._pool.abort_everywhere(
                channel.request_id, channel.holder_ids - {progress.finished_by}
            )
            for request_id, instance_ids in channel.abandoned:
                self._pool.abort_everywhere(request_id, instance_ids)

    async def _wait_for_space(
        self, ticket: AdmissionTicket, progress: Progress, space: object, num_tokens: int
    ) -> bool:
        """Every instance that could take the request was full: wait in a queue place until a
        request ends (or a while, as a worker may free space on its own), then place it again.
        False when it cannot wait: its deadline passed, or nothing runs whose end could free
        space, or no pool is large enough (then it never fits); OVERLOADED when no queue place
        is left. A cancel here leaves the ticket
        parked; the caller's release() frees its queue place."""
        deadline_at = progress.recovery.deadline_at
        wait_s = _SPACE_RETRY_S
        if deadline_at is not None:
            wait_s = min(wait_s, deadline_at - time.monotonic())
        if wait_s <= 0 or not self._pool.space_may_free(num_tokens):
            return False
        try:
            self._admission.park(ticket)
        except AdmissionFull as exc:
            message = f"no worker has KV space for the request, and {exc}"
            raise GenerationFailed(FailureKind.OVERLOADED, message) from exc
        self._update_queue_gauges()
        await self._pool.wait_for_space(space, wait_s)
        await self._admission.resume(ticket)
        self._update_queue_gauges()
        return True

    def _recover(self, failure: GenerationFailed, progress: Progress) -> None:
        """Count a recovery from `failure`, or re-raise it (or what replaces it)."""
        progress.recovery.take(failure, len(progress.sent_token_ids))
        if progress.sent_token_ids:
            self._metrics.request_migrations.inc()
        else:
            self._metrics.request_retries.inc()

    def _update_queue_gauges(self) -> None:
        self._metrics.num_requests_waiting.set(self._admission.num_waiting)
        self._metrics.num_requests_running.set(self._admission.num_running)

    async def _stream(
        self,
        request: ValidatedRequest,
        channel: RequestChannel,
        progress: Progress,
        dispatch: Dispatch,
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks in token order. Events that queued up while the client was being served go
        out as one chunk: under load that means fewer, larger messages, not a growing backlog."""
        while True:
            items = await channel.take_all()
            merged: GenerationChunk | None = None
            try:
                for item in items:
                    if is_stale(item, channel, progress):
                        continue
                    for event in self._in_order(item, progress, dispatch):
                        self._release_prefill_once_decoding(
                            channel, progress, event, dispatch.prefill_id
                        )
                        chunk = self._on_event(request, progress, event)
                        self._dispatcher.progress(dispatch, len(progress.sent_token_ids))
                        merged = chunk if merged is None else _concat(merged, chunk)
                        if chunk.finish_reason is not None:
                            yield merged
                            return
            except GenerationFailed:
                if merged is not None:  # tokens that came before the failure are the client's
                    yield merged
                raise
            if merged is not None:
                yield merged

    @staticmethod
    def _release_prefill_once_decoding(
        channel: RequestChannel, progress: Progress, event: TokenEvent, prefill_id: str
    ) -> None:
        """Once the first token is in and the decode instance has sent a step of its own, the
        KV has landed there: the prefill instance holds nothing more for the request, so losing
        it must not end the stream (nor does the request's end need to abort it)."""
        if event.source and event.source == progress.decode_instance != prefill_id:
            progress.decode_started = True
        if progress.decode_started and progress.prefilled:
            channel.holder_ids.discard(prefill_id)

    def _in_order(
        self, item: TokenEvent | InstanceLost, progress: Progress, dispatch: Dispatch
    ) -> list[TokenEvent]:
        """The events to handle now: the first token must come before any decode step."""
        if isinstance(item, InstanceLost):
            raise GenerationFailed(
                FailureKind.UNAVAILABLE,
                f"worker {item.instance_id} became unavailable ({item.reason}); retry the request",
                lost_instance=item.instance_id,
            )
        if progress.prefilled or item.source in ("", dispatch.prefill_id):
            if not progress.prefilled:  # the prompt no longer waits on the prefill instance
                progress.prefilled = True
                self._dispatcher.prefilled(dispatch, item.timings)
            events = [item, *progress.early_events]
            progress.early_events.clear()
            return events
        progress.early_events.append(item)  # a decode step overtook the first token
        return []

    def _on_event(
        self, request: ValidatedRequest, progress: Progress, event: TokenEvent
    ) -> GenerationChunk:
        if event.finish_reason == "error":
            progress.finished_by = event.source or None
            if event.failed_peer:  # the same end as the router noticing that peer is gone
                raise GenerationFailed(
                    FailureKind.UNAVAILABLE,
                    f"worker {event.failed_peer} became unavailable ({event.error}); "
                    "retry the request",
                    lost_instance=event.failed_peer,
                )
            raise GenerationFailed(
                FailureKind.WORKER_ERROR,
                f"worker {event.source or '?'} failed the request: {event.error or 'no detail'}",
            )
        # a placement after a migration scores a longer prompt: the client has the prompt's
        prompt_logprobs = event.prompt_logprobs if progress.first_token_at is None else None
        self._note_token_times(progress, event)
        text = progress.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            text += progress.detokenizer.flush()
        check = progress.stop_matcher.add(text)
        text, finish_reason, stop_reason = check.text, event.finish_reason, ""
        token_ids, logprobs = list(event.token_ids), event.logprobs
        if check.stop_string is not None:
            finish_reason, stop_reason = "stop", check.stop_string
            token_ids = progress.through_stop(token_ids, check.num_after)
            logprobs = None if logprobs is None else logprobs[: len(token_ids)]
        elif finish_reason is not None:
            text += progress.stop_matcher.flush()
            progress.finished_by = event.source or None
        if finish_reason is None:
            chunk = GenerationChunk(request.request_id, token_ids, text)
        else:
            chunk = self._last_chunk(request, progress, token_ids, text, finish_reason, stop_reason)
        if logprobs is None and prompt_logprobs is None:
            return chunk
        return dataclasses.replace(chunk, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _note_token_times(self, progress: Progress, event: TokenEvent) -> None:
        now = time.perf_counter()
        if progress.first_token_at is None:
            progress.first_token_at = now
            progress.first_placed_at = progress.placed_at
            self._metrics.time_to_first_token.observe(now - progress.accepted_at)
        elif event.token_ids:
            progress.recovery.resumed()
            self._metrics.inter_token_latency.observe(now - progress.last_token_at)
        progress.last_token_at = now
        progress.sent_token_ids.extend(event.token_ids)
        self._metrics.generation_tokens.inc(len(event.token_ids))
        if event.timings is not None and not progress.recovery.migrations:
            merge_timings(progress.worker_timings, event.timings)

    def _last_chunk(
        self,
        request: ValidatedRequest,
        progress: Progress,
        token_ids: list[int],
        text: str,
        finish_reason: str,
        stop_reason: str,
    ) -> GenerationChunk:
        assert progress.first_token_at is not None
        num_after_first = len(progress.sent_token_ids) - 1
        worker = progress.worker_timings
        recovery = progress.recovery
        clock = RouterClock(
            progress.accepted_at,
            progress.dispatched_at,
            progress.first_token_at,
            progress.last_token_at,
            len(progress.sent_token_ids),
        )
        lost_before_first = progress.first_placed_at - progress.dispatched_at
        timings = request_timings(
            clock,
            worker,
            recovery.retries,
            recovery.migrations,
            lost_before_first + recovery.recovery_s,
        )
        self._observe_finish(timings, finish_reason, num_after_first)
        return GenerationChunk(
            request.request_id,
            token_ids,
            text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_completion_tokens=len(progress.sent_token_ids),
            num_cached_tokens=worker.num_cached_tokens,
            num_spec_proposed_tokens=worker.num_spec_proposed_tokens,
            num_spec_accepted_tokens=worker.num_spec_accepted_tokens,
            timings=timings,
            prefill_instance=progress.prefill_instance,
            decode_instance=progress.decode_instance,
            placement=progress.placement,
        )

    def _observe_finish(self, timings: RouterTimings, finish_reason: str, num_after: int) -> None:
        self._metrics.e2e_request_latency.observe(timings.e2e_s)
        if num_after > 0:
            self._metrics.time_per_output_token.observe(timings.per_token_s)
        if timings.kv_transfer_s > 0:
            self._metrics.kv_transfer_time.observe(timings.kv_transfer_s)
        self._metrics.request_success.labels(finish_reason).inc()


def _after(lost: GenerationFailed | None, failure: GenerationFailed) -> GenerationFailed:
    """A dispatch failure, told after the loss it was recovering from (if any)."""
    if lost is None:
        return failure
    message = f"{lost}; no other worker could take the request over: {failure}"
    return GenerationFailed(failure.kind, message, lost.lost_instance)


def _concat(earlier: GenerationChunk, later: GenerationChunk) -> GenerationChunk:
    """One chunk for two consecutive ones (`earlier` is not the last)."""
    logprobs = later.logprobs
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return dataclasses.replace(
        later,
        token_ids=earlier.token_ids + later.token_ids,
        text=earlier.text + later.text,
        logprobs=logprobs,
        prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
    )
