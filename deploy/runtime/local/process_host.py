"""Host one worker object in a process of its own and call its methods from another.

The plain-process control plane: tests, and running without Ray. (deploy/runtime/ray/ wraps the same
worker objects in Ray actors.) Calls are pickled over a pipe; the child serves each call on its
own thread, so a long poll (`poll_events`) never blocks a `submit` or an `abort`.

    parent: ProcessWorker.call(Submit(req, ticket)) ──pipe──▶ child: command.run(worker)
            ◀── ("ok", result) | ("error", exception) ──

A call is a typed command object (worker/protocol.py's WorkerCall for workers): no method name
travels as a string, and `call` returns the command's own result type.

Every call has a timeout; a dead child turns every pending and later call into WorkerUnavailable.

Control messages between workers (deploy/runtime/local/control_relay.py) come up the same pipe: a
`PipeControl` among the factory's arguments is the worker's `send_control`; in the child it
writes `(CONTROL, "control", (instance_id, pickled message))`, and the parent's reader hands the
pair to the relay. Each worker has a pipe of its own, so one killed mid-write breaks only its own.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

from engine.child_signals import ignore_terminal_signals, terminal_signals_blocked
from engine.gc_tuning import freeze_startup_heap
from worker.protocol import WorkerUnavailable

logger = logging.getLogger(__name__)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class HostedCall(Protocol[R_co]):
    """A call on the hosted object: `run(obj)` calls the object's own method."""

    def run(self, worker: Any) -> R_co: ...


class _Shutdown:
    """Shut the hosted object down and end the process."""

    def run(self, worker: Any) -> None:
        if hasattr(worker, "shutdown"):
            worker.shutdown()


_FAILED_EXIT_DELAY_S = 1.0
CONTROL = -1  # the call id of a control message going up the pipe (call ids start at 0)
# In a worker process: sends a control message up its pipe (set by _child_main).
_send_up: Callable[[str, bytes], None] | None = None


class PipeControl:
    """A worker's `send_control(instance_id, message)` when it is hosted by ProcessWorker.

    Picklable: it travels with the factory's arguments. In the parent it carries `sink` (the
    relay's `deliver`), which ProcessWorker's reader calls; in the child it writes to the pipe."""

    def __init__(self, sink: Callable[[str, bytes], None] | None = None) -> None:
        self.sink = sink

    def __getstate__(self) -> dict[str, Any]:
        return {"sink": None}  # the sink lives in the parent

    def __call__(self, instance_id: str, message: Any) -> None:
        if _send_up is None:
            raise RuntimeError("PipeControl works only inside a ProcessWorker's process")
        _send_up(instance_id, pickle.dumps(message))


def _child_main(conn: Connection, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    ignore_terminal_signals()  # the parent stops this process; a closed pipe means it is gone
    import torch

    torch.set_num_threads(1)
    send_lock = threading.Lock()

    def reply(call_id: int, status: str, value: Any) -> None:
        with send_lock:
            try:
                conn.send((call_id, status, value))
            except Exception as exc:  # an unpicklable result or error: say so, as text
                conn.send((call_id, "error", RuntimeError(f"{type(value).__name__}: {exc}")))

    def send_up(instance_id: str, data: bytes) -> None:
        with send_lock:
            conn.send((CONTROL, "control", (instance_id, data)))

    global _send_up
    _send_up = send_up
    try:
        worker = factory(*args, **kwargs)
    except BaseException as exc:
        reply(0, "error", RuntimeError(f"worker failed to start: {exc}\n{traceback.format_exc()}"))
        return
    freeze_startup_heap()
    reply(0, "ok", os.getpid())
    if isinstance(getattr(worker, "failed", None), threading.Event):
        threading.Thread(target=exit_when_failed, args=(worker,), daemon=True).start()

    def serve(call_id: int, command: HostedCall[Any]) -> None:
        try:
            reply(call_id, "ok", command.run(worker))
        except BaseException as exc:
            reply(call_id, "error", exc)

    while True:
        try:
            call_id, command = conn.recv()
        except (EOFError, OSError):  # the parent is gone: still stop what the worker started
            try:
                _Shutdown().run(worker)
            except Exception:
                traceback.print_exc()
            break
        if isinstance(command, _Shutdown):
            try:
                command.run(worker)
            finally:
                reply(call_id, "ok", None)
            break
        threading.Thread(target=serve, args=(call_id, command), daemon=True).start()

    # Leave without interpreter teardown: with torch and transformers loaded it costs about 2 s
    # of CPU per process (a cluster shutting down on few cores waits many times that), and gloo
    # groups whose peers are already gone can stall it further. The worker has shut down and
    # the reply is written; nothing is left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_when_failed(worker: Any) -> None:
    """A worker whose loop died (a dead TP rank, a failed step) cannot serve again: exit, so its
    runtime sees a dead process and starts a new one, rank group and all (the process host's
    parent, or Ray for a restartable actor)."""
    worker.failed.wait()
    time.sleep(_FAILED_EXIT_DELAY_S)  # the router's next poll takes the requests' error events
    try:
        worker.shutdown()  # reaps the TP ranks that are left
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


_LIVE: weakref.WeakSet[ProcessWorker] = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's own exit hook, so it runs before it
def _kill_leftovers() -> None:
    """A parent exiting (a failed test, a crash) kills the workers it did not shut down: each
    child waits on the parent's pipe, and multiprocessing's exit hook would wait on the child."""
    for worker in list(_LIVE):
        worker.kill()


class ProcessWorker:
    """A worker object living in a spawned child process."""

    def __init__(
        self,
        factory: Callable[..., Any],
        *args: Any,
        name: str = "pdserve-worker",
        start_timeout_s: float = 180.0,
        on_spawn: Callable[[ProcessWorker], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """Blocks until the worker is built. `on_spawn(self)` runs as soon as the process
        exists, so that a caller may kill a start that is no longer wanted (a cluster stopping
        while a restart loads the model)."""
        self.name = name
        controls = [a for a in (*args, *kwargs.values()) if isinstance(a, PipeControl)]
        self._control_sink = controls[0].sink if controls else None
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_child_main, args=(child_conn, factory, args, kwargs), name=name, daemon=False
        )
        self._pending: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        started: Future[Any] = Future()
        self._pending[0] = started
        with terminal_signals_blocked():
            self._process.start()
        child_conn.close()
        _LIVE.add(self)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()
        try:
            if on_spawn is not None:
                on_spawn(self)
            self.pid: int = started.result(timeout=start_timeout_s)
        except FutureTimeout:
            self.kill()
            raise WorkerUnavailable(f"{name} did not start within {start_timeout_s:.0f}s") from None
        except BaseException:
            self.kill()
            raise

    def is_alive(self) -> bool:
        return self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def call(self, command: HostedCall[R], timeout_s: float = 30.0) -> R:
        call_id, future = self._send(command)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise WorkerUnavailable(
                f"{self.name} did not answer {type(command).__name__} within {timeout_s:.1f}s"
            ) from None
        finally:
            with self._lock:
                self._pending.pop(call_id, None)

    def post(self, command: HostedCall[R]) -> Future[R]:
        """Send a call without waiting for it: the child serves each call on a thread of its own,
        so calls posted together run together. The future holds the answer, or WorkerUnavailable
        if the child exits first."""
        call_id, future = self._send(command)
        future.add_done_callback(lambda _: self._forget(call_id))
        return future

    def _send(self, command: HostedCall[R]) -> tuple[int, Future[R]]:
        with self._lock:
            if self._closed or not self._process.is_alive():
                raise WorkerUnavailable(f"{self.name} is not running")
            call_id = next(self._ids)
            future: Future[R] = Future()
            self._pending[call_id] = future
            try:
                self._conn.send((call_id, command))
            except (OSError, ValueError) as exc:
                self._pending.pop(call_id, None)
                raise WorkerUnavailable(f"{self.name}: {exc}") from None
        return call_id, future

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._pending.pop(call_id, None)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to shut down, then make sure the process is gone."""
        if self._closed:
            return
        try:
            if self._process.is_alive():
                self.call(_Shutdown(), timeout_s=timeout_s)
        except WorkerUnavailable:
            pass
        finally:
            self._closed = True
            self._process.join(timeout_s)
            self.kill()

    def kill(self) -> None:
        # One at a time: a cluster stopping kills a worker whose start (another thread) is
        # failing and killing it too; two closes of one pipe at once fail with EBADF.
        with self._kill_lock:
            self._closed = True
            if self._process.is_alive():
                self._process.kill()
            self._process.join(10)
            self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                call_id, status, value = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a garbled message: this pipe cannot be trusted any more
                logger.exception("%s: unreadable message on its pipe; stopping it", self.name)
                self._process.kill()
                break
            if call_id == CONTROL:
                self._forward_control(*value)
                continue
            with self._lock:
                future = self._pending.get(call_id)
            if future is not None and not future.done():
                if status == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(value)
        with self._lock:  # the child is gone: nothing pending will ever be answered
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(WorkerUnavailable(f"{self.name} exited"))

    def _forward_control(self, instance_id: str, data: bytes) -> None:
        if self._control_sink is None:
            return  # a worker without peers (a colocated one) sends none
        try:
            self._control_sink(instance_id, data)
        except Exception:  # never let a message stop this worker's reader
            logger.exception("%s: a control message for %s was lost", self.name, instance_id)
