"""A whole pdserve cluster on this machine without Ray: every worker a plain process.

    with LocalCluster(spec) as cluster:          # spec: deploy/config/cluster_spec.ClusterSpec
        cluster.start(progress=print)            # workers, control relay, router; returns address
        ...gRPC clients on cluster.address...
    # shutdown: router drains, every worker process (and its TP ranks) stopped and joined

    this process                                         worker processes (ProcessWorker)
    Router (asyncio loop thread) ─ ProcessHandle ──────▶ Worker, role PREFILL (TP=k spawns k-1 ranks)
                                 ─ ProcessHandle ──────▶ Worker, role DECODE  x N
    control relay ◀── each worker's own pipe ── send_control(instance_id, message) in a worker
                  ──▶ workers[instance_id].post(Deliver(message)), one thread per addressee

The Ray runtime's shape (deploy/runtime/ray/cluster.py), a pipe where Ray has actor calls. Benchmarks use it for colocated layouts too (N colocated Worker replicas), optionally with each
worker pinned to its own cores (`spec.pin_cpus`). On CUDA each worker gets GPUs of its own, one per
TP rank in instance order, through CUDA_VISIBLE_DEVICES (its ranks then take cuda:0..k-1, as under
Ray). A layout with more ranks than GPUs shares them between workers when the KV moves through
the same-node transport (one GPU runs the default disaggregated layout at TP=1, each process with
its own KV pool); over NCCL it is refused before anything starts, since NCCL refuses two ranks on
one GPU.

Keeping serving: a watch thread restarts every worker process that died (killed, or exited
because its loop failed, e.g. a TP rank died), with the same arguments, and swaps it into the
router's handle. A restarted prefill instance first sends requests through its decode peers
(deploy/runtime/channels.settle_prefill_channels), so that they drop their channels to the dead
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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.channels import settle_prefill_channels
from deploy.runtime.local.control_relay import ControlRelay
from deploy.runtime.local.handles import ProcessHandle
from deploy.runtime.local.process_host import PipeControl, ProcessWorker
from deploy.runtime.router_host import Progress, ServingCluster
from engine.gc_tuning import unfreeze_heap
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import InstanceLoad, Load, ProcessIds, Role, WorkerUnavailable

_WATCH_INTERVAL_S = 0.2
_WATCH_JOIN_S = 10.0  # the watch thread's calls are bounded by the workers' timeouts
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def pinned_worker(
    cpu_ids: list[int] | None,
    config: WorkerConfig,
    instance_id: str,
    control: PipeControl,
    gpu_ids: list[str] | None = None,
) -> Worker:
    """The worker process's factory: pin it to `cpu_ids` and show it only `gpu_ids` (its TP
    ranks inherit both), then build the worker. CUDA is not initialized before this point."""
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    if gpu_ids is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return Worker(config, instance_id, control)


def cpu_sets(num_ranks_per_worker: list[int], cpu_ids: list[int]) -> list[list[int]]:
    """One core per rank (per torch thread of a rank), handed out in order and wrapping around
    when they outnumber the cores."""
    sets: list[list[int]] = []
    next_index = 0
    for num_ranks in num_ranks_per_worker:
        sets.append(sorted({cpu_ids[(next_index + j) % len(cpu_ids)] for j in range(num_ranks)}))
        next_index += num_ranks
    return sets


def cores_per_worker(configs: Iterable[WorkerConfig]) -> list[int]:
    """The cores each worker is pinned to on CPU: one per torch thread of each TP rank."""
    return [c.engine.tensor_parallel_size * (c.engine.num_threads or 1) for c in configs]


def gpu_sets(
    num_ranks_per_worker: list[int], num_gpus: int, share: bool = False
) -> list[list[int]]:
    """One GPU per rank, handed out in order. More ranks than GPUs: with `share` (the KV moves
    through the same-node transport, not NCCL) workers take turns on the GPUs, each worker's
    ranks still on GPUs of their own (its TP group is NCCL), each process its own memory
    share; without it, an error."""
    needed = sum(num_ranks_per_worker)
    if needed > num_gpus and share and max(num_ranks_per_worker, default=0) <= num_gpus:
        shared, next_gpu = [], 0
        for num_ranks in num_ranks_per_worker:
            shared.append(sorted((next_gpu + j) % num_gpus for j in range(num_ranks)))
            next_gpu += num_ranks
        return shared
    if needed > num_gpus:
        raise ValueError(
            f"this layout needs {needed} GPUs (one per TP rank of every instance) and "
            f"{num_gpus} are visible: lower the instance counts or tensor_parallel_size, "
            "or run on a machine with more GPUs"
        )
    sets, next_gpu = [], 0
    for num_ranks in num_ranks_per_worker:
        sets.append(list(range(next_gpu, next_gpu + num_ranks)))
        next_gpu += num_ranks
    return sets


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them for a child
    (its own CUDA_VISIBLE_DEVICES, if set, maps a child's indices back to the machine's)."""
    import torch  # device_count reads NVML: CUDA is not initialized in the router process

    count = torch.cuda.device_count()
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return [str(index) for index in range(count)]
    return [name.strip() for name in names.split(",") if name.strip()][:count]


class RestartBackoff:
    """When each instance may be restarted: at once the first time, then after a failed
    restart 1 s, doubling up to 30 s, until a restart succeeds (a worker that cannot start, say
    its model folder is bad, must not reload the model on every tick of the watch thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._delay_s: dict[str, float] = {}
        self._not_before: dict[str, float] = {}

    def due(self, instance_id: str) -> bool:
        return self._clock() >= self._not_before.get(instance_id, 0.0)

    def failed(self, instance_id: str) -> float:
        """Records a failed restart; returns the wait before the next one."""
        previous = self._delay_s.get(instance_id)
        delay_s = FIRST_BACKOFF_S if previous is None else min(2 * previous, MAX_BACKOFF_S)
        self._delay_s[instance_id] = delay_s
        self._not_before[instance_id] = self._clock() + delay_s
        return delay_s

    def succeeded(self, instance_id: str) -> None:
        self._delay_s.pop(instance_id, None)
        self._not_before.pop(instance_id, None)


class LocalCluster(ServingCluster):
    """Workers in plain processes, a control relay, and the gRPC router on a background loop."""

    def __init__(
        self, spec: ClusterSpec, start_timeout_s: float = 180.0, restart_workers: bool = True
    ) -> None:
        super().__init__(spec, start_timeout_s)
        self.restart_workers = restart_workers  # False: a dead worker stays down (tests)
        self.workers: dict[str, ProcessWorker] = {}
        self._relay = ControlRelay(self.workers)
        self._pins: dict[str, list[int] | None] = {}
        self._gpus: dict[str, list[str] | None] = {}  # each worker's CUDA_VISIBLE_DEVICES
        self._restarting: str | None = None  # the watch thread restarts one at a time
        self.num_restarts: dict[str, int] = {}
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()  # _stopping vs. a restart's new worker joining `workers`
        self._starting: ProcessWorker | None = None  # the process of that restart
        self._backoff = RestartBackoff()

    # ------------------------------------------------------------------ lifecycle
    def _start(self, say: Progress) -> None:
        """Every worker (concurrently), then the router and the watch thread."""
        self._start_workers(say)
        say("starting the router")
        self._start_router()
        if self.restart_workers:
            self._watch = threading.Thread(
                target=self._keep_alive, name="worker-watch", daemon=True
            )
            self._watch.start()

    def _start_workers(self, say: Progress) -> None:
        configs = self.worker_configs()
        tp_sizes = [config.engine.tensor_parallel_size for config in configs.values()]
        pins = cpu_sets(cores_per_worker(configs.values()), sorted(os.sched_getaffinity(0)))
        for instance_id, cpu_ids in zip(configs, pins, strict=True):
            self._pins[instance_id] = cpu_ids if self.spec.pin_cpus else None
        if any(config.engine.device.startswith("cuda") for config in configs.values()):
            names = visible_gpus()
            # Workers may share a GPU when no KV channel needs NCCL between them.
            share = all(c.kv_transfer.transport != "network" for c in configs.values())
            sets = gpu_sets(tp_sizes, len(names), share)
            for instance_id, gpus in zip(configs, sets, strict=True):
                self._gpus[instance_id] = [names[index] for index in gpus]

        def start_one(instance_id: str) -> ProcessWorker:
            tp_size = configs[instance_id].engine.tensor_parallel_size
            say(f"starting {instance_id} (TP={tp_size}): loading {self.spec.model_dir}")
            began = time.monotonic()
            worker = self._new_worker(instance_id)
            say(f"{instance_id} ready ({time.monotonic() - began:.1f} s)")
            return worker

        with ThreadPoolExecutor(len(configs)) as pool:
            futures = {i: pool.submit(start_one, i) for i in configs}
            errors = []
            for instance_id, future in futures.items():  # keep every worker that started,
                try:  # so that shutdown stops it
                    self.workers[instance_id] = future.result()
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def _handle(self, instance_id: str, role: Role, prefill_tp: dict[str, int]) -> ProcessHandle:
        return ProcessHandle(
            instance_id,
            role,
            self.workers[instance_id],
            call_timeout_s=self.spec.router.worker_timeout_s,
            prefill_tp_sizes=prefill_tp,
        )

    def _stop_workers(self) -> None:
        """Every worker and its TP ranks stopped and joined."""
        with ThreadPoolExecutor(max(1, len(self.workers))) as pool:
            list(pool.map(lambda worker: worker.shutdown(), list(self.workers.values())))
        self.workers.clear()
        self._relay.stop()
        unfreeze_heap()  # this process outlives the cluster (a test, a benchmark's sweep)

    def _stop_restarts(self) -> None:
        """No restart from here on: one in progress has its process killed (a model load can
        take minutes) and its worker never joins `workers`."""
        with self._lock:
            self._stopping.set()
            starting = self._starting
        if starting is not None:
            starting.kill()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(_WATCH_JOIN_S)
            self._watch = None

    # ------------------------------------------------------------------ queries
    def status(self) -> list[InstanceLoad]:
        """Every worker's load report; one that is down or restarting reports healthy=False and
        nothing running (never its last load)."""
        loads = []
        for instance_id, worker in list(self.workers.items()):
            try:
                if instance_id == self._restarting:
                    raise WorkerUnavailable(f"{instance_id} is restarting")
                loads.append(worker.call(Load(), timeout_s=10.0))
            except WorkerUnavailable:
                role = Role(instance_id.rsplit("-", 1)[0])
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
    def _new_worker(
        self, instance_id: str, on_spawn: Callable[[ProcessWorker], None] | None = None
    ) -> ProcessWorker:
        config, control = self.spec.worker_config(instance_id), self._relay.sender()
        return ProcessWorker(
            pinned_worker,
            self._pins[instance_id],
            config,
            instance_id,
            control,
            self._gpus.get(instance_id),
            name=instance_id,
            start_timeout_s=self.start_timeout_s,
            on_spawn=on_spawn,
        )

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
                    print(
                        f"restarting {instance_id} failed: {exc!r}; again in {delay_s:.0f} s",
                        flush=True,
                    )

    def _spawned(self, worker: ProcessWorker) -> None:
        with self._lock:
            self._starting = worker
            stopping = self._stopping.is_set()
        if stopping:  # shutdown began before this process existed
            worker.kill()

    def _restart(self, instance_id: str, dead: ProcessWorker) -> None:
        self._restarting = instance_id
        try:
            dead.kill()  # reap it
            print(f"{instance_id} died (exit code {dead.exitcode}); restarting it", flush=True)
            try:
                worker = self._new_worker(instance_id, on_spawn=self._spawned)
            finally:
                with self._lock:
                    self._starting = None
            with self._lock:
                if self._stopping.is_set():  # shutdown came during the start
                    worker.kill()
                    return
                self.workers[instance_id] = worker  # the relay delivers the peers' acks to it
            if self.spec.instance(instance_id).prefills:
                self._settle_prefill(instance_id, worker)
            handle = self.handles[instance_id]
            assert isinstance(handle, ProcessHandle)
            handle.worker = worker  # the router reaches it from here on
            self.num_restarts[instance_id] = self.num_restarts.get(instance_id, 0) + 1
        finally:
            self._restarting = None

    def _settle_prefill(self, instance_id: str, worker: ProcessWorker) -> None:
        timeout_s = self.spec.router.worker_timeout_s
        settle_prefill_channels(
            lambda command: worker.call(command, timeout_s),
            instance_id,
            self.spec.worker_config(instance_id).engine.tensor_parallel_size,
            list(self.spec.kv_peers(instance_id).targets),
            lambda peer_id, command: self.workers[peer_id].call(command, timeout_s),
            timeout_s,
        )
