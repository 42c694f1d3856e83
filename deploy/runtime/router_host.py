"""The serving process of both runtimes (`ServingCluster`, which LocalCluster and RayCluster
extend): the router on an event loop thread of its own, a start in steps, shutdown.

    with open_cluster(config, model_dir) as cluster:   # deploy/runtime/launch.py
        address = cluster.start(progress=print)        # each step said; returns once SERVING
        cluster.address, cluster.metrics_port, cluster.http_port, cluster.serving()
    # shutdown(): the router drains for shutdown_grace_s, then the runtime stops its workers

Plain processes reach their workers through ProcessHandles, Ray through RayHandles; the router
itself runs here either way. It used to run in a Ray actor of its own in Ray mode, where it
shared an asyncio loop with Ray's actor-call machinery: under a burst of 1,500 streams that loop
accepted gRPC calls more slowly than it finished them, the excess waited inside gRPC core where
admission never sees a call, and a health probe timed out while health said SERVING. A process
of its own adds nothing to availability either: the Ray actors are owned by this process and go
down with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.handle import HandleBase
from engine.gc_tuning import freeze_startup_heap
from router.server import Router
from worker.config import WorkerConfig
from worker.protocol import Role

logger = logging.getLogger(__name__)
_LOOP_TIMEOUT_S = 60.0
_SETTLE_TIMEOUT_S = 10.0
_SETTLE_GRACE_S = 1.0  # for gRPC's per-call tasks to end by themselves once the server stopped
T = TypeVar("T")
C = TypeVar("C", bound="ServingCluster")
Progress = Callable[[str], None]


def seconds_since_launch() -> float | None:
    """Seconds since this process was launched, from /proc (Linux), or None where there is none."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(after_name[19])  # field 22, starttime, in clock ticks since boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ServingCluster:
    """What both runtimes share: the spec, the router hosted here, a start in steps, the router's
    ports and health, and shutdown on leaving a `with` block."""

    def __init__(self, spec: ClusterSpec, start_timeout_s: float) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.router: Router | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.handles: dict[str, HandleBase] = {}  # by instance id, once the router starts
        self._closed = False

    def start(self, progress: Progress | None = None) -> str:
        """Bring the whole cluster up; returns the router's address once health is SERVING.
        A start that fails (or is interrupted by a signal) shuts down what it started."""
        say = progress or (lambda _line: None)
        started_at = time.monotonic()
        try:
            self._start(say)
            say("waiting for the router's health SERVING")
            self._wait_serving()
        except BaseException:
            self.shutdown(grace_s=0.1)
            raise
        took = f"{time.monotonic() - started_at:.1f} s"
        launched = seconds_since_launch()
        if launched is not None:  # what the user waited: the imports before start() count too
            took = f"{launched:.1f} s from launch (the cluster's start {took})"
        say(f"ready on {self.address} in {took}")
        return self.address

    def _start(self, say: Progress) -> None:
        """The runtime's own start-up steps, the router's last."""
        raise NotImplementedError

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self.serving():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the router at {self.address} did not report SERVING within "
                    f"{self.start_timeout_s:.0f}s"
                )
            time.sleep(0.05)

    def _start_router(self) -> None:
        """The router on its loop thread, with a handle (`_handle`) per worker."""
        spec, instances = self.spec, self.spec.instances()
        prefill_tp = {
            i.instance_id: i.config.engine.tensor_parallel_size for i in instances if i.prefills
        }
        for i in instances:
            tp = prefill_tp if i.decodes_remote else {}
            self.handles[i.instance_id] = self._handle(i.instance_id, i.role, tp)
        front = [h for h in self.handles.values() if h.role != Role.DECODE]
        back = [h for h in self.handles.values() if h.role == Role.DECODE]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="router-loop", daemon=True
        )
        self._thread.start()
        self.router = Router(spec.router, front, back)
        self._run(self.router.start())
        freeze_startup_heap()  # the model and the router are built: keep them out of GC scans

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = _LOOP_TIMEOUT_S) -> T:
        """Run `coroutine` on the router's loop and wait for its result."""
        assert self._loop is not None, "start() the router first"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def _stop_router(self, grace_s: float | None) -> None:
        """Stop admitting, let in-flight streams finish, abort the rest, close the loop."""
        if self._loop is None:
            return
        grace = self.spec.router.shutdown_grace_s if grace_s is None else grace_s
        try:
            if self.router is not None:
                self._run(self.router.stop(grace), timeout_s=_LOOP_TIMEOUT_S + grace)
        finally:
            try:
                self._run(_settle_tasks(), timeout_s=_SETTLE_TIMEOUT_S)
            except Exception as exc:  # the loop must close all the same
                logger.warning("settling the router loop's tasks failed: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(_LOOP_TIMEOUT_S)
            self._loop.close()
            self._loop = None

    def _handle(self, instance_id: str, role: Role, prefill_tp: dict[str, int]) -> HandleBase:
        """The router's handle on one worker (for a decode one, every prefill instance's TP
        size: its tickets' re-sharding plan)."""
        raise NotImplementedError

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop admitting, let in-flight streams finish for `grace_s` (default: the router's
        `shutdown_grace_s`), abort the rest, then stop every worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_restarts()
        try:
            self._stop_router(grace_s)
        except Exception as exc:  # the workers must stop all the same
            logger.warning("stopping the router failed: %r", exc)
        self._stop_workers()

    def _stop_restarts(self) -> None:
        """Before the drain: no worker may be restarted from here on."""

    def _stop_workers(self) -> None:
        raise NotImplementedError

    def worker_configs(self) -> dict[str, WorkerConfig]:
        """The config each worker is built with, by instance id, prefill first."""
        return {i: self.spec.worker_config(i) for i in self.spec.instance_ids()}

    def serving(self) -> bool:
        """True while the router is up and its workers can take requests (what its gRPC health
        reports, SERVING, after each load refresh)."""
        if self._loop is None or self.router is None:
            return False
        return self._run(_healthy(self.router))

    @property
    def address(self) -> str:
        """host:port of the router's gRPC server ("" before `start`)."""
        return "" if self.router is None else self.router.address

    @property
    def metrics_port(self) -> int | None:
        return None if self.router is None else self.router.metrics_port

    @property
    def http_port(self) -> int | None:
        return None if self.router is None else self.router.http_port

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


async def _healthy(router: Router) -> bool:
    return router.pool.healthy()  # on the router's loop, which owns the pool's state


async def _settle_tasks() -> None:
    """Let what is still pending on the router's loop end, cancel what will not, and await it
    (as `asyncio.run` does on leaving): gRPC's own per-call tasks can outlive `server.stop()` by
    a tick, and a loop closed under them printed "Task was destroyed but it is pending!" after a
    GeneratorExit traceback (seen once in CI, SIGINT to a plain cluster's group mid-stream)."""
    current = asyncio.current_task()
    pending = {task for task in asyncio.all_tasks() if task is not current}
    if pending:
        _done, pending = await asyncio.wait(pending, timeout=_SETTLE_GRACE_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
