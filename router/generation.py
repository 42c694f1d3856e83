"""One request's life in the router: admit, dispatch, stream, and clean up on every path.

    admit (bounded queue) -> pick decode + prefill (policies) -> reserve KV on decode
      -> submit to prefill -> events: first token (prefill), then the rest (decode)
      -> detokenize, cut at stop strings -> chunks to the servicer

Workers know the request by its channel's id, unique to this attempt and placement; the client's
request_id appears only in what goes back to the client (two attempts may share it). Only the
chosen instances speak for the request: an event from another one, or an error or loss of an
instance that no longer holds anything for it (the prefill once the decode instance is decoding),
is dropped.
Whatever ends the request (finish, stop string, client cancel or deadline, error), `finally`
frees its admission slot and tells every instance that may hold state for it to abort, except
the one whose finish event ended it (that one freed its state itself). gRPC stays out of this
file: failures are `GenerationFailed` with a kind the servicer maps to a status code.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from router.admission import AdmissionController, AdmissionFull
from router.detokenizer import IncrementalDetokenizer
from router.dispatch import Dispatcher
from router.generation_errors import FailureKind, GenerationFailed
from router.metrics import RouterMetrics
from router.stop_strings import StopStringMatcher
from router.tokenizer import RouterTokenizer
from router.validation import ValidatedRequest
from router.worker_api import RequestTimings, TokenEvent
from router.worker_pool import InstanceLost, RequestChannel, WorkerPool


@dataclass(frozen=True)
class RouterTimings:
    router_queue_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    per_token_s: float = 0.0
    e2e_s: float = 0.0


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
    timings: RouterTimings | None = None  # on the last chunk
    prefill_instance: str = ""  # on the last chunk: where the request ran
    decode_instance: str = ""


@dataclass
class _Progress:
    """The mutable state of one streaming request."""

    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    accepted_at: float  # perf_counter
    dispatched_at: float = 0.0
    prefill_instance: str = ""
    decode_instance: str = ""
    first_token_at: float | None = None
    last_token_at: float = 0.0
    num_output_tokens: int = 0
    worker_timings: RequestTimings = field(default_factory=RequestTimings)
    early_events: list[TokenEvent] = field(default_factory=list)  # decode before first token
    finished_by: str | None = None  # instance whose finish event ended the request
    decode_started: bool = False  # an event from the decode instance: the KV has landed


class GenerationRunner:
    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        admission: AdmissionController,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._dispatcher = dispatcher
        self._admission = admission
        self._tokenizer = tokenizer
        self._metrics = metrics

    async def generate(
        self, request: ValidatedRequest, deadline_s: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks of new tokens and text; the last has finish_reason. Raises GenerationFailed.
        `deadline_s`: the time the client has left, if it set a deadline (admission refuses a
        request that would spend it all in the queue)."""
        progress = _Progress(
            IncrementalDetokenizer(self._tokenizer),
            StopStringMatcher(request.stop_strings),
            accepted_at=time.perf_counter(),
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
            dispatch = await self._dispatcher.dispatch(request, channel, time.time())
            progress.prefill_instance = dispatch.prefill_id
            progress.decode_instance = dispatch.decode_id or ""
            async for chunk in self._stream(request, channel, progress, dispatch.prefill_id):
                yield chunk
        finally:
            self._pool.close_channel(channel)
            self._admission.release(ticket)
            self._update_queue_gauges()
            if dispatch is not None:
                self._dispatcher.release(dispatch, prefilled=progress.first_token_at is not None)
            self._pool.abort_everywhere(
                channel.request_id, channel.holder_ids - {progress.finished_by}
            )
            for request_id, instance_ids in channel.abandoned:
                self._pool.abort_everywhere(request_id, instance_ids)

    def _update_queue_gauges(self) -> None:
        self._metrics.num_requests_waiting.set(self._admission.num_waiting)
        self._metrics.num_requests_running.set(self._admission.num_running)

    async def _stream(
        self,
        request: ValidatedRequest,
        channel: RequestChannel,
        progress: _Progress,
        prefill_id: str,
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks in token order. Events that queued up while the client was being served go
        out as one chunk: under load that means fewer, larger messages, not a growing backlog."""
        while True:
            items = await channel.take_all()
            merged: GenerationChunk | None = None
            for item in items:
                if _is_stale(item, channel, progress):
                    continue
                for event in self._in_order(item, progress, prefill_id):
                    self._release_prefill_once_decoding(channel, progress, event, prefill_id)
                    chunk = self._on_event(request, progress, event)
                    merged = chunk if merged is None else _concat(merged, chunk)
                    if chunk.finish_reason is not None:
                        yield merged
                        return
            if merged is not None:
                yield merged

    @staticmethod
    def _release_prefill_once_decoding(
        channel: RequestChannel, progress: _Progress, event: TokenEvent, prefill_id: str
    ) -> None:
        """Once the first token is in and the decode instance has sent a step of its own, the
        KV has landed there: the prefill instance holds nothing more for the request, so losing
        it must not end the stream (nor does the request's end need to abort it)."""
        if event.source and event.source == progress.decode_instance != prefill_id:
            progress.decode_started = True
        if progress.decode_started and progress.first_token_at is not None:
            channel.holder_ids.discard(prefill_id)

    def _in_order(
        self, item: TokenEvent | InstanceLost, progress: _Progress, prefill_id: str
    ) -> list[TokenEvent]:
        """The events to handle now: the first token must come before any decode step."""
        if isinstance(item, InstanceLost):
            raise GenerationFailed(
                FailureKind.UNAVAILABLE,
                f"worker {item.instance_id} became unavailable ({item.reason}); retry the request",
            )
        if progress.first_token_at is not None or item.source in ("", prefill_id):
            events = [item, *progress.early_events]
            progress.early_events.clear()
            return events
        progress.early_events.append(item)  # a decode step overtook the first token
        return []

    def _on_event(
        self, request: ValidatedRequest, progress: _Progress, event: TokenEvent
    ) -> GenerationChunk:
        if event.finish_reason == "error":
            progress.finished_by = event.source or None
            if event.failed_peer:  # the same end as the router noticing that peer is gone
                raise GenerationFailed(
                    FailureKind.UNAVAILABLE,
                    f"worker {event.failed_peer} became unavailable ({event.error}); "
                    "retry the request",
                )
            raise GenerationFailed(
                FailureKind.WORKER_ERROR,
                f"worker {event.source or '?'} failed the request: {event.error or 'no detail'}",
            )
        self._note_token_times(progress, event)
        text = progress.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            text += progress.detokenizer.flush()
        check = progress.stop_matcher.add(text)
        text, finish_reason, stop_reason = check.text, event.finish_reason, ""
        if check.stop_string is not None:
            finish_reason, stop_reason = "stop", check.stop_string
        elif finish_reason is not None:
            text += progress.stop_matcher.flush()
            progress.finished_by = event.source or None
        if finish_reason is None:
            return GenerationChunk(request.request_id, list(event.token_ids), text)
        return self._last_chunk(request, progress, event, text, finish_reason, stop_reason)

    def _note_token_times(self, progress: _Progress, event: TokenEvent) -> None:
        now = time.perf_counter()
        if progress.first_token_at is None:
            progress.first_token_at = now
            self._metrics.time_to_first_token.observe(now - progress.accepted_at)
        elif event.token_ids:
            self._metrics.inter_token_latency.observe(now - progress.last_token_at)
        progress.last_token_at = now
        progress.num_output_tokens += len(event.token_ids)
        self._metrics.generation_tokens.inc(len(event.token_ids))
        if event.timings is not None:
            _merge_timings(progress.worker_timings, event.timings)

    def _last_chunk(
        self,
        request: ValidatedRequest,
        progress: _Progress,
        event: TokenEvent,
        text: str,
        finish_reason: str,
        stop_reason: str,
    ) -> GenerationChunk:
        assert progress.first_token_at is not None
        num_after_first = progress.num_output_tokens - 1
        per_token_s = (
            (progress.last_token_at - progress.first_token_at) / num_after_first
            if num_after_first > 0
            else 0.0
        )
        worker = progress.worker_timings
        timings = RouterTimings(
            router_queue_s=progress.dispatched_at - progress.accepted_at,
            prefill_queue_s=worker.prefill_queue_s,
            prefill_s=worker.prefill_s,
            kv_transfer_s=worker.kv_transfer_s,
            decode_queue_s=worker.decode_queue_s,
            decode_s=worker.decode_s,
            first_token_s=progress.first_token_at - progress.accepted_at,
            per_token_s=per_token_s,
            e2e_s=progress.last_token_at - progress.accepted_at,
        )
        self._observe_finish(timings, finish_reason, num_after_first)
        return GenerationChunk(
            request.request_id,
            list(event.token_ids),
            text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_completion_tokens=progress.num_output_tokens,
            num_cached_tokens=worker.num_cached_tokens,
            timings=timings,
            prefill_instance=progress.prefill_instance,
            decode_instance=progress.decode_instance,
        )

    def _observe_finish(self, timings: RouterTimings, finish_reason: str, num_after: int) -> None:
        self._metrics.e2e_request_latency.observe(timings.e2e_s)
        if num_after > 0:
            self._metrics.time_per_output_token.observe(timings.per_token_s)
        if timings.kv_transfer_s > 0:
            self._metrics.kv_transfer_time.observe(timings.kv_transfer_s)
        self._metrics.request_success.labels(finish_reason).inc()


def _is_stale(
    item: TokenEvent | InstanceLost, channel: RequestChannel, progress: _Progress
) -> bool:
    """An item the request must ignore: the loss of an instance it no longer depends on, an
    event of an abandoned placement or from an instance it was not placed on, or an error from
    an instance it no longer depends on (a prefill that failed after the decode instance took
    over: the KV has landed there)."""
    if isinstance(item, InstanceLost):
        return item.instance_id not in channel.holder_ids
    if item.request_id != channel.request_id:
        return True  # queued before the dispatcher gave up on that placement
    if not item.source:
        return False  # a worker that does not say who it is (tests' in-process handles)
    if item.source not in (progress.prefill_instance, progress.decode_instance):
        return True
    return item.finish_reason == "error" and item.source not in channel.holder_ids


def _concat(earlier: GenerationChunk, later: GenerationChunk) -> GenerationChunk:
    """One chunk for two consecutive ones (`earlier` is not the last)."""
    return dataclasses.replace(
        later, token_ids=earlier.token_ids + later.token_ids, text=earlier.text + later.text
    )


def _merge_timings(merged: RequestTimings, update: RequestTimings) -> None:
    """Prefill fields come with the first token, decode fields with the last: keep each set one."""
    names = ("prefill_queue_s", "prefill_s", "handed_off_at", "landed_at", "decode_queue_s")
    for name in (*names, "decode_s"):
        value = getattr(update, name)
        if value:
            setattr(merged, name, value)
    if update.num_cached_tokens:
        merged.num_cached_tokens = update.num_cached_tokens
