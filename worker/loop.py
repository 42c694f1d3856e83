"""A worker's engine loop on a thread of its own: commands in, token events out.

The one Worker (worker/instance.py) has this shape. The scheduler, the block pool and the
executor are touched by the loop thread only; every public method of a worker runs its body on
that thread through `call` (or `@on_loop_thread`), between two steps, so none needs a lock:

    caller threads ──call(fn)──▶ command queue ──▶ loop thread: commands, then step(), repeat
    caller threads ◀──poll_events(timeout)── event list ◀── _emit(events) (one list per step)

When a step has nothing to do, the loop sleeps until a command arrives, or `_IDLE_WAIT_S` while
`busy()` says something is in flight that only polling moves on (a KV transfer, a deadline), or
else until the next liveness check; every `_LIVENESS_INTERVAL_S` it calls `check_liveness` (a
worker checks its TP ranks there, so a dead rank is noticed with no traffic too). An idle worker
then wakes 4 times a second, not 200: on a shared core every wake-up delays the busy process
beside it (three idle clusters beside a busy one made its decode steps 15% slower). A step or
check that raises marks the worker unhealthy, sets `failed` and stops the loop; `fail_all` lets
the subclass end every request it holds with an error event first. The worker's host then
replaces it (deploy/: a process that exits, an actor that dies).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from engine.rank_device import device_thread
from worker.protocol import TokenEvent, WorkerUnavailable

T = TypeVar("T")
P = ParamSpec("P")
L = TypeVar("L", bound="WorkerLoop")
Emit = Callable[[list[TokenEvent]], None]  # how a worker's parts hand it their token events
_IDLE_WAIT_S = 0.005  # a loop with work in flight but nothing to compute polls this often
_LIVENESS_INTERVAL_S = 0.25


class WorkerLoop:
    """Subclasses implement `step() -> bool` (True if it did work) and may override `fail_all`."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        # The device the loop's steps run on (a subclass sets it once its engine is built): the
        # loop thread binds it first (engine/rank_device.py), as CUDA's current device is per thread.
        self.device: torch.device | None = None
        self.failed = threading.Event()  # set with `error` when the loop died
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._events: list[TokenEvent] = []
        self._events_ready = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # set when the loop died; the worker is then unhealthy
        # Cleared by a host that readies the worker further after building it (a restarted
        # prefill settling its KV channels): until set again, the worker reports unhealthy.
        self.ready = threading.Event()
        self.ready.set()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = device_thread(self.device, self._run, f"pdserve-{self.instance_id}")
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wake the loop
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def healthy(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return self.error is None and alive and self.ready.is_set()

    # ---------------------------------------------------------- thread-safe API
    def call(self, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
        """Run `fn` on the loop thread between steps and return its result (or raise its error)."""
        if self.error is not None:
            raise WorkerUnavailable(f"{self.instance_id} stopped after an error: {self.error}")
        if self._thread is None or not self._thread.is_alive():
            raise WorkerUnavailable(f"{self.instance_id} is not running")
        future: Future[T] = Future()
        self._commands.put((fn, future))
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise WorkerUnavailable(
                f"{self.instance_id} did not answer within {timeout_s:.1f}s"
            ) from None

    def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        """Every event emitted since the last poll; waits up to timeout_s for the first."""
        with self._events_ready:
            if not self._events and not self._stop.is_set():
                self._events_ready.wait(timeout_s)
            events, self._events = self._events, []
        return events

    # ------------------------------------------------------- for subclasses
    def step(self) -> bool:
        raise NotImplementedError

    def fail_all(self, message: str) -> None:
        """End every request the worker holds with an error event (loop thread, on a crash)."""

    def check_liveness(self) -> None:
        """Raise if the worker can no longer serve (loop thread, while idle)."""

    def busy(self) -> bool:
        """Something is in flight that only polling moves on (loop thread, while idle)."""
        return True

    def _emit(self, events: list[TokenEvent]) -> None:
        if events:
            with self._events_ready:
                self._events.extend(events)
                self._events_ready.notify_all()

    # --------------------------------------------------------------- the loop
    def _run(self) -> None:
        next_check = time.monotonic() + _LIVENESS_INTERVAL_S
        try:
            while not self._stop.is_set():
                self._run_commands()
                if self._stop.is_set():
                    break
                if not self.step():
                    if time.monotonic() >= next_check:
                        self.check_liveness()
                        next_check = time.monotonic() + _LIVENESS_INTERVAL_S
                    wait_s = max(_IDLE_WAIT_S, next_check - time.monotonic())
                    self._run_commands(wait_s=_IDLE_WAIT_S if self.busy() else wait_s)
        except BaseException as exc:  # the loop must report, never vanish silently
            self.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            try:
                self.fail_all(f"worker {self.instance_id} failed: {self.error}")
            finally:
                self._fail_pending_commands()
                self.failed.set()
        finally:
            with self._events_ready:
                self._events_ready.notify_all()

    def _run_commands(self, wait_s: float = 0.0) -> None:
        """Run every queued command; with none queued, wait up to `wait_s` for the first."""
        while True:
            try:
                fn, future = self._commands.get(block=wait_s > 0, timeout=wait_s)
            except queue.Empty:
                return
            wait_s = 0.0
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(WorkerUnavailable(f"{self.instance_id}: {self.error}"))


def on_loop_thread(method: Callable[Concatenate[L, P], T]) -> Callable[Concatenate[L, P], T]:
    """A worker method whose body runs on the loop thread, between two steps (through `call`)."""

    @functools.wraps(method)
    def call(self: L, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.call(lambda: method(self, *args, **kwargs))

    return call
