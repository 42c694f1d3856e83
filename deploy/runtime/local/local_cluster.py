"""A whole pdserve cluster on this machine without Ray: every worker a plain process.

    with LocalCluster(spec) as cluster:          # spec: deploy/cluster_spec.ClusterSpec
        cluster.start(progress=print)            # workers, control relay, router; returns address
        ...gRPC clients on cluster.address...
    # shutdown: router drains, every worker process (and its TP ranks) stopped and joined

    this process                                         worker processes (ProcessWorker)
    Router (asyncio loop thread) ─ ProcessHandle ──────▶ Worker, role PREFILL (TP=k spawns k-1 ranks)
                                 ─ ProcessHandle ──────▶ Worker, role DECODE  x N
    control relay ◀── each worker's own pipe ── send_control(instance_id, message) in a worker
                  ──▶ workers[instance_id].post(Deliver(message)), one thread per addressee

The same shape as the Ray runtime (deploy/runtime/ray/cluster.py), with a pipe where Ray has actor calls.
Benchmarks use it for colocated layouts too (N colocated Worker replicas), optionally with each
worker pinned to its own cores (`spec.pin_cpus`).

Keeping serving: a watch thread restarts every worker process that died (killed, or exited
because its loop failed, e.g. a TP rank died), with the same arguments, and swaps it into the
router's handle. A restarted prefill instance first sends requests through its decode peers
(deploy/runtime/ray/channels.settle_prefill_channels), so that they drop their channels to the dead
process before the router uses it. A restarted decode instance has new channel endpoints, so
its peers dial fresh channels. Until it is back, `status()` reports the instance down. A
restart that fails is tried again after a backoff (1 s, doubling up to 30 s), so a worker that
cannot start does not reload the model on every tick. Shutdown does not wait for a restart in
progress: it kills the process being started.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.control_relay import ControlRelay
from deploy.runtime.local.handles import ProcessHandle
from deploy.runtime.local.process_host import ProcessWorker
from deploy.runtime.local.restart_backoff import RestartBackoff
from deploy.runtime.router_host import RouterHost
from engine.gc_tuning import unfreeze_heap
from router.server import Router
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import (
    InstanceLoad,
    Load,
    ProcessIds,
    Reserve,
    Role,
    Submit,
    WorkerUnavailable,
)

Progress = Callable[[str], None]
_WATCH_INTERVAL_S = 0.2
_WATCH_JOIN_S = 10.0  # the watch thread's calls are bounded by the workers' timeouts


class PinnedFactory:
    """Builds the worker after pinning its process to `cpu_ids` (its TP ranks inherit them)."""

    def __init__(self, factory: Callable[..., Any], cpu_ids: list[int] | None) -> None:
        self.factory = factory
        self.cpu_ids = cpu_ids

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cpu_ids:
            os.sched_setaffinity(0, self.cpu_ids)
        return self.factory(*args, **kwargs)


def cpu_sets(num_ranks_per_worker: list[int], cpu_ids: list[int]) -> list[list[int]]:
    """One core per rank, handed out in order and wrapping around when ranks outnumber cores."""
    sets: list[list[int]] = []
    next_index = 0
    for num_ranks in num_ranks_per_worker:
        sets.append(sorted({cpu_ids[(next_index + j) % len(cpu_ids)] for j in range(num_ranks)}))
        next_index += num_ranks
    return sets


class LocalCluster:
    """Workers in plain processes, a control relay, and the gRPC router on a background loop."""

    def __init__(
        self, spec: ClusterSpec, start_timeout_s: float = 180.0, restart_workers: bool = True
    ) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.restart_workers = restart_workers  # False: a dead worker stays down (tests)
        self.workers: dict[str, ProcessWorker] = {}
        self.host = RouterHost(spec.router)
        self._handles: list[ProcessHandle] = []
        self._relay: ControlRelay | None = None
        self._plan: dict[str, tuple[Callable[..., Any], tuple, int]] = {}
        self._handle_of: dict[str, ProcessHandle] = {}
        self._restarting: set[str] = set()
        self.num_restarts: dict[str, int] = {}
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()  # _stopping vs. a restart's new worker joining `workers`
        self._starting: dict[str, ProcessWorker] = {}  # processes of restarts in progress
        self._backoff = RestartBackoff()

    # ------------------------------------------------------------------ lifecycle
    def start(self, progress: Progress | None = None) -> str:
        """Start every worker (concurrently), the relay and the router; returns host:port."""
        say = progress or (lambda _line: None)
        started_at = time.monotonic()
        self._relay = ControlRelay(self.workers)
        try:
            self._start_workers(say)
            say("starting the router")
            self._start_router()
            if self.restart_workers:
                self._watch = threading.Thread(
                    target=self._keep_alive, name="worker-watch", daemon=True
                )
                self._watch.start()
        except BaseException:
            self.shutdown()
            raise
        say(f"serving on {self.address} ({time.monotonic() - started_at:.1f} s)")
        return self.address

    def _start_workers(self, say: Progress) -> None:
        plan = self._worker_plan()
        pins = cpu_sets([tp for _, _, _, tp in plan], sorted(os.sched_getaffinity(0)))

        for index, (instance_id, factory, args, tp_size) in enumerate(plan):
            pinned = PinnedFactory(factory, pins[index] if self.spec.pin_cpus else None)
            self._plan[instance_id] = (pinned, args, tp_size)

        def start_one(index: int) -> tuple[str, ProcessWorker]:
            instance_id, _, _, tp_size = plan[index]
            say(f"starting {instance_id} (TP={tp_size}): loading {self.spec.model_dir}")
            began = time.monotonic()
            worker = self._new_worker(instance_id)
            say(f"{instance_id} ready ({time.monotonic() - began:.1f} s)")
            return instance_id, worker

        with ThreadPoolExecutor(len(plan)) as pool:
            futures = [pool.submit(start_one, i) for i in range(len(plan))]
            errors = []
            for future in futures:  # keep every worker that started, so shutdown stops it
                try:
                    instance_id, worker = future.result()
                    self.workers[instance_id] = worker
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def worker_configs(self) -> dict[str, WorkerConfig]:
        """The config each worker process is built with, by instance id, prefill first."""
        return {i: self.spec.worker_config(i) for i in self.spec.instance_ids()}

    def _worker_plan(self) -> list[tuple[str, Callable[..., Any], tuple, int]]:
        """(instance_id, factory, factory args, TP size) for each worker, prefill first."""
        assert self._relay is not None
        control = self._relay.sender()
        plan: list[tuple[str, Callable[..., Any], tuple, int]] = []
        for instance_id, config in self.worker_configs().items():
            tp = config.engine.tensor_parallel_size
            plan.append((instance_id, Worker, (config, instance_id, control), tp))
        return plan

    def _start_router(self) -> None:
        spec = self.spec
        prefill_tp = {} if spec.prefill is None else {
            i: spec.prefill.engine.tensor_parallel_size for i in spec.instance_ids()
        }  # fmt: skip
        front, back = [], []
        timeout_s = spec.router.worker_timeout_s  # as the Ray handles get it
        for instance_id, worker in self.workers.items():
            if instance_id.startswith("decode"):
                back.append(ProcessHandle(instance_id, Role.DECODE, worker, call_timeout_s=timeout_s,
                                          prefill_tp_sizes=prefill_tp))  # fmt: skip
            else:
                role = Role.COLOCATED if spec.is_colocated else Role.PREFILL
                front.append(ProcessHandle(instance_id, role, worker, call_timeout_s=timeout_s))
        self._handles = [*front, *back]
        self._handle_of = {handle.instance_id: handle for handle in self._handles}
        self.host.start(front, back)

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop admitting, let in-flight streams finish for `grace_s` (default: the router's
        `shutdown_grace_s`), abort the rest, then stop every worker and its ranks; idempotent."""
        self._stop_restarts()
        self.host.stop(grace_s)
        with ThreadPoolExecutor(max(1, len(self.workers))) as pool:
            list(pool.map(lambda worker: worker.shutdown(), list(self.workers.values())))
        self.workers.clear()
        if self._relay is not None:
            self._relay.stop()
            self._relay = None
        unfreeze_heap()  # this process outlives the cluster (a test, a benchmark's sweep)

    def kill(self) -> None:
        """Stop at once, without draining (a second signal): every worker process is killed;
        their TP ranks follow within seconds (their driver's store is gone). Then shutdown()."""
        self._stop_restarts()
        for worker in list(self.workers.values()):
            worker.kill()
        self.shutdown(grace_s=0)

    def _stop_restarts(self) -> None:
        """No restart from here on: one in progress has its process killed (a model load can
        take minutes) and its worker never joins `workers`."""
        with self._lock:
            self._stopping.set()
            starting = list(self._starting.values())
        for worker in starting:
            worker.kill()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(_WATCH_JOIN_S)
            self._watch = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ queries
    @property
    def router(self) -> Router | None:
        return self.host.router

    @property
    def address(self) -> str:
        return self.host.address

    @property
    def metrics_port(self) -> int | None:
        return self.host.metrics_port

    @property
    def http_port(self) -> int | None:
        return self.host.http_port

    def status(self) -> list[InstanceLoad]:
        """Every worker's load report; one that is down or restarting reports healthy=False and
        nothing running (never its last load)."""
        loads = []
        for instance_id, worker in list(self.workers.items()):
            try:
                if instance_id in self._restarting:
                    raise WorkerUnavailable(f"{instance_id} is restarting")
                loads.append(worker.call(Load(), timeout_s=10.0))
            except WorkerUnavailable:
                role = Role.DECODE if instance_id.startswith("decode") else Role.PREFILL
                loads.append(InstanceLoad(instance_id, role, healthy=False))
        return loads

    def process_ids(self) -> list[int]:
        """Every worker process and the TP ranks it spawned."""
        ids: list[int] = []
        for worker in self.workers.values():
            try:
                ids.extend(worker.call(ProcessIds(), timeout_s=10.0))
            except WorkerUnavailable:
                ids.append(worker.pid)
        return ids

    # ------------------------------------------------------------------ internals
    def _new_worker(self, instance_id: str, on_spawn: Any = None) -> ProcessWorker:
        factory, args, _ = self._plan[instance_id]
        return ProcessWorker(
            factory, *args, name=instance_id, start_timeout_s=self.start_timeout_s,
            on_spawn=on_spawn,
        )  # fmt: skip

    def _keep_alive(self) -> None:
        """The watch thread: restart each worker process that died, one at a time."""
        while not self._stopping.wait(_WATCH_INTERVAL_S):
            for instance_id, worker in list(self.workers.items()):
                if worker.is_alive() or self._stopping.is_set():
                    continue
                if not self._backoff.due(instance_id):
                    continue
                try:
                    self._restart(instance_id, worker)
                    self._backoff.succeeded(instance_id)
                except Exception as exc:
                    if self._stopping.is_set():
                        return  # shutdown killed the process being started
                    delay_s = self._backoff.failed(instance_id)
                    print(f"restarting {instance_id} failed: {exc!r}; again in {delay_s:.0f} s",
                          flush=True)  # fmt: skip

    def _spawned(self, instance_id: str, worker: ProcessWorker) -> None:
        with self._lock:
            self._starting[instance_id] = worker
            stopping = self._stopping.is_set()
        if stopping:  # shutdown began before this process existed
            worker.kill()

    def _restart(self, instance_id: str, dead: ProcessWorker) -> None:
        self._restarting.add(instance_id)
        try:
            dead.kill()  # reap it
            print(f"{instance_id} died (exit code {dead.exitcode}); restarting it", flush=True)
            try:
                worker = self._new_worker(instance_id, lambda w: self._spawned(instance_id, w))
            finally:
                with self._lock:
                    self._starting.pop(instance_id, None)
            with self._lock:
                if self._stopping.is_set():  # shutdown came during the start
                    worker.kill()
                    return
                self.workers[instance_id] = worker  # the relay delivers the peers' acks to it
            if instance_id.startswith("prefill"):
                self._settle_prefill(instance_id, worker)
            self._handle_of[instance_id].worker = worker  # the router reaches it from here on
            self.num_restarts[instance_id] = self.num_restarts.get(instance_id, 0) + 1
        finally:
            self._restarting.discard(instance_id)

    def _settle_prefill(self, instance_id: str, worker: ProcessWorker) -> None:
        from deploy.runtime.ray.channels import (
            settle_prefill_channels,  # imports ray: only when needed
        )

        decode_ids = [i for i in self.workers if i.startswith("decode")]
        _, _, tp_size = self._plan[instance_id]
        timeout_s = self.spec.router.worker_timeout_s

        def reserve(peer_id: str, request: Any, prefill_id: str, tp: int) -> Any:
            return self.workers[peer_id].call(Reserve(request, prefill_id, tp), timeout_s)

        settle_prefill_channels(
            _Remote(worker, timeout_s), instance_id, tp_size, dict.fromkeys(decode_ids, 1), "",
            timeout_s, reserve,
        )  # fmt: skip


class _Remote:
    """A ProcessWorker as the worker object deploy/runtime/ray/channels drives (submit, load)."""

    def __init__(self, worker: ProcessWorker, timeout_s: float) -> None:
        self.worker = worker
        self.timeout_s = timeout_s

    def submit(self, request: Any, ticket: Any) -> None:
        self.worker.call(Submit(request, ticket), timeout_s=self.timeout_s)

    def load(self) -> InstanceLoad:
        return self.worker.call(Load(), timeout_s=self.timeout_s)
