"""The colocated baseline: one worker that runs both phases, prefill chunks mixed into decode steps.

This is the vLLM / SARATHI way, and what the benchmarks compare disaggregation against. The
worker is `engine.LLMEngine` on a `WorkerLoop` thread: every step the scheduler puts the running
sequences' decodes first and fills the rest of the token budget with prompt chunks, so a long
prompt never stalls the tokens already streaming.

    router ──submit(req, None)──▶ loop thread: engine.add_request   (Overloaded past the bound)
           ──abort(id)─────────▶ loop thread: engine.abort         (its "abort" event follows)
           ◀─poll_events()───── one TokenEvent per request per step (first one carries timings)

Timings (seconds, measured here; the router adds its own queue time):
  prefill_queue_s  submit -> the start of the first step that computed any of its prompt
  prefill_s        that step's start -> its first token (every chunk and the decode steps of
                   others that its chunks shared steps with)
  decode_s         first token -> last token (on the last event)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.messages import (
    InstanceLoad,
    Overloaded,
    RequestTimings,
    Role,
    TokenEvent,
    WorkerRequest,
)
from engine.outputs import StepOutput
from engine.request import Request
from engine.worker_loop import WorkerLoop


@dataclass
class _Tracked:
    """A request's clocks (time.perf_counter) from submit to its last event."""

    request: Request
    submitted_at: float
    started_at: float | None = None  # start of the first step that computed its prompt
    first_token_at: float | None = None
    timings: RequestTimings | None = None  # set with the first token


class ColocatedWorker(WorkerLoop):
    """An LLMEngine behind the worker API (role COLOCATED). Starts its loop on construction.

    `engine` is an EngineConfig (the worker builds its engine) or an LLMEngine that nothing
    else touches from now on (the loop thread owns it).

    `max_waiting_requests` / `max_waiting_tokens` bound the queue of requests not yet admitted
    (requests / prompt tokens); `submit` past either raises Overloaded so the router can pick
    another instance instead of queueing without limit.
    """

    role = Role.COLOCATED

    def __init__(
        self,
        instance_id: str,
        engine: EngineConfig | LLMEngine,
        *,
        max_waiting_requests: int = 256,
        max_waiting_tokens: int | None = None,
        idle_wait_s: float = 0.005,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        if max_waiting_tokens is not None and max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1 or None, got {max_waiting_tokens}")
        super().__init__(instance_id, idle_wait_s=idle_wait_s)
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._tracked: dict[str, _Tracked] = {}  # loop thread only, like the engine
        # Requests whose prompt no step has computed yet (their queue time is still running).
        self._not_started: dict[str, _Tracked] = {}
        self.start()

    # ------------------------------------------------------------------ worker API
    def submit(self, request: WorkerRequest, ticket: object | None = None) -> None:
        """Queue a request. Raises Overloaded when the queue is full, ValueError when the
        request can never run here (bad token ids, prompt >= max_model_len, id in use)."""
        if ticket is not None:
            raise ValueError("a colocated worker decodes itself; submit with ticket=None")
        submitted_at = time.perf_counter()
        self.call(lambda: self._add(request, submitted_at))

    def abort(self, request_id: str) -> bool:
        """Free the request's state in any stage; its "abort" event comes with the next step.
        False (and no event) if the worker does not hold it."""
        return self.call(lambda: self.engine.abort(request_id))

    def load(self) -> InstanceLoad:
        return self.call(self._load)

    def shutdown(self) -> None:
        self.stop()
        self.engine.shutdown()

    # ------------------------------------------------------------------ loop thread
    def _add(self, request: WorkerRequest, submitted_at: float) -> None:
        if request.request_id in self._tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        stats = self.engine.stats
        if stats.num_waiting >= self.max_waiting_requests:
            raise Overloaded(
                f"{self.instance_id} has {stats.num_waiting} requests waiting "
                f"(bound {self.max_waiting_requests})"
            )
        num_tokens = len(request.prompt_token_ids)
        if (
            self.max_waiting_tokens is not None
            and stats.num_queued_prompt_tokens + num_tokens > self.max_waiting_tokens
        ):
            raise Overloaded(
                f"{self.instance_id} has {stats.num_queued_prompt_tokens} prompt tokens waiting; "
                f"{num_tokens} more would pass the bound {self.max_waiting_tokens}"
            )
        engine_request = self.engine.add_request(
            request.request_id, request.prompt_token_ids, request.params, request.arrival_time
        )
        tracked = _Tracked(engine_request, submitted_at)
        self._tracked[request.request_id] = tracked
        self._not_started[request.request_id] = tracked

    def step(self) -> bool:
        engine = self.engine
        if not engine.has_unfinished():
            return False
        step_started_at = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if self._not_started:
            self._mark_started(step_started_at)
        self._emit([self._to_event(output, now) for output in outputs])
        return True

    def _mark_started(self, step_started_at: float) -> None:
        """Stop the queue clock of every request this step computed (or ended)."""
        started = [
            request_id
            for request_id, tracked in self._not_started.items()
            if tracked.request.num_computed_tokens > 0 or tracked.request.is_finished
        ]
        for request_id in started:
            self._not_started.pop(request_id).started_at = step_started_at

    def _to_event(self, output: StepOutput, now: float) -> TokenEvent:
        tracked = self._tracked.get(output.request_id)
        timings = None
        if tracked is not None:
            if tracked.timings is None and output.new_token_ids:
                tracked.first_token_at = now
                timings = tracked.timings = self._first_token_timings(tracked, now)
            if output.finished:
                timings = self._final_timings(tracked, now)
                del self._tracked[output.request_id]
                self._not_started.pop(output.request_id, None)
        return TokenEvent(
            output.request_id,
            list(output.new_token_ids),
            output.finish_reason if output.finished else None,
            output.error,
            self.instance_id,
            timings,
        )

    @staticmethod
    def _first_token_timings(tracked: _Tracked, now: float) -> RequestTimings:
        started_at = tracked.started_at if tracked.started_at is not None else now
        return RequestTimings(
            prefill_queue_s=started_at - tracked.submitted_at,
            prefill_s=now - started_at,
            num_cached_tokens=tracked.request.num_cached_tokens,
        )

    @staticmethod
    def _final_timings(tracked: _Tracked, now: float) -> RequestTimings:
        """The last event's timings: the first token's, plus the decode time since then."""
        if tracked.timings is None or tracked.first_token_at is None:  # ended before any token
            started_at = tracked.started_at if tracked.started_at is not None else now
            return RequestTimings(prefill_queue_s=started_at - tracked.submitted_at)
        return replace(tracked.timings, decode_s=now - tracked.first_token_at)

    def _load(self) -> InstanceLoad:
        return InstanceLoad.from_stats(
            self.instance_id, Role.COLOCATED, self.engine.stats, self.error is None
        )

    def check_liveness(self) -> None:
        self.engine.executor.check_ranks()  # a dead TP rank: this instance must be replaced

    def fail_all(self, message: str) -> None:
        """The loop crashed: end every request it holds with an error event."""
        self._emit(
            [
                TokenEvent(request_id, [], "error", message, self.instance_id)
                for request_id in self._tracked
            ]
        )
        self._tracked.clear()
        self._not_started.clear()
