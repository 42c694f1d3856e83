"""A colocated worker inside the router's process: `engine.LLMEngine` behind the PrefillHandle
interface (role COLOCATED), for tests, demos and single-process serving.

The engine is not thread-safe, so one engine thread owns it: it applies queued commands
(add, abort), runs `step()` while there is work, turns each StepOutput into a TokenEvent and
publishes a load snapshot. The router's event loop only enqueues commands and drains events:

    router loop                       engine thread
    submit/abort --- commands ----->  add_request / abort
    poll_events  <--- events -------  step() -> TokenEvents   (wakes the loop thread-safely)
    load()       <--- snapshot -----  engine.stats after each step
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.outputs import StepOutput
from engine.request import Request
from router.worker_api import (
    InstanceLoad,
    Overloaded,
    RequestTimings,
    Role,
    TokenEvent,
    WorkerRequest,
)

_IDLE_WAIT_S = 0.05


@dataclass
class _Tracked:
    request: Request
    submitted_at: float  # perf_counter
    first_token: bool = False


class InProcessColocatedHandle:
    role = Role.COLOCATED

    def __init__(
        self, instance_id: str, engine: LLMEngine | EngineConfig, max_waiting_requests: int = 256
    ) -> None:
        self.instance_id = instance_id
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._max_waiting = max_waiting_requests
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._events: list[TokenEvent] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = asyncio.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._load = self._snapshot()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{instance_id}", daemon=True)
        self._thread.start()

    # -- the handle interface (router loop) ---------------------------------------------------

    async def load(self) -> InstanceLoad:
        return self._load

    async def submit(self, request: WorkerRequest, ticket: object | None) -> None:
        if ticket is not None:
            raise ValueError("a colocated instance decodes itself; submit it with ticket=None")
        if self._load.num_waiting_requests >= self._max_waiting:
            raise Overloaded(f"{self.instance_id} has {self._max_waiting} requests waiting")
        self._loop = asyncio.get_running_loop()
        self._commands.put(("add", request))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        self._loop = asyncio.get_running_loop()
        self._wakeup.clear()
        with self._lock:
            has_events = bool(self._events)
        if not has_events:
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        with self._lock:
            events, self._events = self._events, []
        return events

    async def close(self) -> None:
        self._stopping.set()
        await asyncio.to_thread(self._thread.join, 30.0)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished()
            self._apply_commands(block=not busy)
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self._publish([self._to_event(out) for out in outputs])
            self._load = self._snapshot()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "add":
                self._add(payload)  # type: ignore[arg-type]
            else:
                self.engine.abort(payload)  # type: ignore[arg-type]
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: WorkerRequest) -> None:
        try:
            engine_request = self.engine.add_request(
                request.request_id, request.prompt_token_ids, request.params, request.arrival_time
            )
        except ValueError as exc:  # the engine can never run it (e.g. longer than its KV pool)
            self._publish([TokenEvent(request.request_id, [], "error", str(exc), self.instance_id)])
            return
        self._tracked[request.request_id] = _Tracked(engine_request, time.perf_counter())

    def _to_event(self, output: StepOutput) -> TokenEvent:
        tracked = self._tracked.get(output.request_id)
        timings = None
        if tracked is not None and not tracked.first_token and output.new_token_ids:
            tracked.first_token = True
            # Colocated, queueing and prefill interleave with other requests' decode steps:
            # prefill_s is the whole wait from submit to the first token.
            timings = RequestTimings(
                prefill_s=time.perf_counter() - tracked.submitted_at,
                num_cached_tokens=tracked.request.num_cached_tokens,
            )
        if output.finished:
            self._tracked.pop(output.request_id, None)
        return TokenEvent(
            output.request_id,
            list(output.new_token_ids),
            output.finish_reason if output.finished else None,
            output.error,
            self.instance_id,
            timings,
        )

    def _publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        with self._lock:
            self._events.extend(events)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wakeup.set)

    def _snapshot(self) -> InstanceLoad:
        stats = self.engine.stats
        return InstanceLoad(
            self.instance_id,
            Role.COLOCATED,
            num_waiting_requests=stats.num_waiting,
            num_waiting_tokens=stats.num_queued_prompt_tokens,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            prefix_cache_hit_rate=stats.prefix_hit_rate,
            num_preemptions=stats.num_preemptions,
        )
