"""RayCluster: the one object the command line uses to run pdserve on Ray.

    with RayCluster(RayClusterConfig(model_dir, prefill_tp_size=2, num_decode_instances=2)) as c:
        address = c.start(progress=print)      # "127.0.0.1:50123", gRPC health SERVING
        c.status()                             # workers, loads, KV usage, health
        c.serve_forever()                      # until SIGINT/SIGTERM, then shutdown()

Start-up, in order (each step reported through `progress` and timed in `startup_timings`):
1. Ray: a local cluster on 127.0.0.1 (deploy/runtime/ray/node.py), or join `config.address`.
2. Placement groups (deploy/runtime/ray/placement.py): each prefill instance STRICT_PACK, one bundle
   per TP rank; decode replicas spread; GPUs or CPU shares claimed as Ray resources.
3. Worker actors (deploy/runtime/ray/actors.py), all at once: each loads the model, forms its TP group
   (rank actors via deploy/runtime/ray/launcher.py) and opens its KV channel endpoints. Ports travel as
   actor-call arguments and results (RankSpec, KVTicket); KV itself never enters Ray.
4. KV channels: one two-token request through every (prefill, decode) pair builds every pair
   channel before the first user request (and checks the hand-off end to end).
5. The router, in this process (deploy/runtime/router_host.py) with a RayHandle per worker actor; then
   wait until gRPC health is SERVING.

Failures: a worker actor whose process dies is restarted by Ray (`max_restarts`) behind the same
name and handle. Its in-flight requests end with UNAVAILABLE ("worker decode-1 became
unavailable (...); retry the request"): pdserve does not re-run them, because tokens already
streamed cannot be taken back and sampling may not be reproducible. New requests avoid the
instance (the router's pool marks it unhealthy) until its load reports healthy again, which is
after its constructor rebuilt the worker and its KV pair channels (deploy/runtime/ray/channels.py). A
restarted prefill driver replaces its TP rank actors (deploy/runtime/ray/launcher.py).

Shutdown (`shutdown()`, also on SIGINT/SIGTERM via `serve_forever` or
`install_signal_handlers`): the router stops admitting and gives in-flight requests
`shutdown_grace_s`, then aborts them; the workers shut down (freeing every block, ending their
TP ranks); every actor is killed, the placement groups removed, and a Ray cluster that this
object started is stopped with every one of its processes, checked by process id.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.runtime.ray.actors import WorkerActor
from deploy.runtime.ray.channels import form_all_channels
from deploy.runtime.ray.config import ClusterStatus, RayClusterConfig, WorkerStatus
from deploy.runtime.ray.handles import RayHandle, actor_name
from deploy.runtime.ray.launcher import rank_actor_name, start_rank_actors
from deploy.runtime.ray.node import LocalRay, connect_ray, start_local_ray
from deploy.runtime.ray.placement import (
    InstancePlacement,
    PlacementPlan,
    place_instances,
    remove_placements,
    wait_until_placed,
)
from deploy.runtime.router_host import RouterHost
from engine.messages import Role

logger = logging.getLogger(__name__)
Progress = Callable[[str], None]
_SERVING = health_pb2.HealthCheckResponse.SERVING


class RayCluster:
    def __init__(self, config: RayClusterConfig) -> None:
        self.config = config
        self.namespace = f"pdserve-{uuid.uuid4().hex[:8]}"
        self.startup_timings: dict[str, float] = {}  # step -> seconds
        self.worker_startup: dict[str, dict[str, float]] = {}  # id -> process start/import/build
        self.placements: list[InstancePlacement] = []
        self.worker_actors: dict[str, Any] = {}
        self.host = RouterHost(config.router_config())
        self.rank_actors: list[Any] = []  # TP ranks 1..k-1 (a restarted driver makes its own)
        self._node: LocalRay | None = None
        self._address = ""
        self._closed = False
        self._stop_requested = threading.Event()
        self._serving = threading.Event()
        self.stop_signal: int | None = None

    @property
    def address(self) -> str:
        """host:port of the router's gRPC server (after `start`)."""
        return self._address

    @property
    def temp_dir(self) -> str | None:
        """The temp dir of the local Ray cluster this object started (None when joined)."""
        return None if self._node is None else self._node.temp_dir

    # ---------------------------------------------------------------- start
    def start(self, progress: Progress | None = None) -> str:
        """Bring the whole cluster up; returns the router's address once health is SERVING."""
        say = progress or (lambda message: None)
        try:
            self._step("ray", say, "starting Ray" if self.config.address is None
                       else f"joining Ray at {self.config.address}", self._start_ray)  # fmt: skip
            if self.temp_dir is not None:
                say(f"Ray temp dir {self.temp_dir}")
            self._step("placement", say, f"reserving {self.config.num_workers} workers",
                       self._place)  # fmt: skip
            self._step("workers", say, "loading the model on every worker", self._start_workers)
            self._step("channels", say, "forming the KV channels", self._form_kv_channels)
            self._step("router", say, "starting the router", self._start_router)
            self._step("health", say, "waiting for gRPC health SERVING", self._wait_serving)
        except BaseException:
            self.shutdown(grace_s=0.1)
            raise
        say(f"serving on {self._address} ({sum(self.startup_timings.values()):.1f}s)")
        return self._address

    def _step(self, key: str, say: Progress, message: str, run: Callable[[], None]) -> None:
        say(message)
        started = time.perf_counter()
        run()
        self.startup_timings[key] = time.perf_counter() - started
        if self._node is not None:
            self._node.remember_processes()

    def _start_ray(self) -> None:
        if self.config.address is None:
            self._node = start_local_ray(self.namespace, self.config.num_cpus)
        else:
            self._node = connect_ray(self.config.address, self.namespace)

    def _place(self) -> None:
        cpus = self.config.num_cpus_per_worker
        if cpus is None:  # share the CPUs: 2 cores and 4 workers -> 0.5 each
            total = ray.cluster_resources().get("CPU", 1.0)
            cpus = max(0.01, min(1.0, math.floor(100 * total / self.config.num_workers) / 100))
        plan = PlacementPlan(
            self.config.num_prefill_instances, self.config.prefill_tp_size,
            self.config.num_decode_instances, self.config.decode_tp_size, self.config.device,
            cpus, dict(self.config.prefill_resources), dict(self.config.decode_resources),
        )  # fmt: skip
        self.placements = place_instances(plan, f"{self.namespace}-")
        wait_until_placed(self.placements, self.config.start_timeout_s)

    def _start_workers(self) -> None:
        remote = ray.remote(WorkerActor)
        pin = self.config.pin_cpus and self.config.device == "cpu"
        for placement in self.placements:
            self.rank_actors.extend(
                start_rank_actors(placement, self.config.num_workers, pin, named=True)
            )
            ranks = [rank_actor_name(placement.instance_id, r) for r in range(1, placement.tp_size)]
            config = (
                self.config.prefill_config() if placement.role == Role.PREFILL
                else self.config.decode_config()
            )  # fmt: skip
            self.worker_actors[placement.instance_id] = remote.options(
                name=actor_name(placement.instance_id),
                max_concurrency=64,
                # Every request makes several calls (submit, reserve, polls, deliver) and the
                # GCS would keep an event record of each: memory grew per request served.
                enable_task_events=False,
                max_restarts=self.config.max_restarts,
                max_task_retries=0,
                num_cpus=placement.num_cpus,
                num_gpus=placement.num_gpus,
                scheduling_strategy=placement.strategy(0),
            ).remote(
                config, placement, self.config.num_workers, pin, self.namespace, ranks,
                self._peers_of(placement.role),
            )  # fmt: skip
        created_at = time.time()
        infos = [actor.info.remote() for actor in self.worker_actors.values()]
        answers = ray.get(infos, timeout=self.config.start_timeout_s)  # built: ready
        for instance_id, info in zip(self.worker_actors, answers, strict=True):
            startup = dict(info["startup"])
            startup["process_start_s"] = startup.pop("started_at") - created_at
            self.worker_startup[instance_id] = startup

    def _form_kv_channels(self) -> None:
        form_all_channels(
            self._actors_of("prefill-"), self._actors_of("decode-"), self.config.prefill_tp_size,
            self.config.prefill_config().kv_transfer.transfer_timeout_s + 10,
        )  # fmt: skip

    def _peers_of(self, role: Role) -> dict[str, int]:
        """The instances a worker of `role` hands KV to or from, with their TP sizes."""
        if role == Role.DECODE:
            names = [f"prefill-{i}" for i in range(self.config.num_prefill_instances)]
            return dict.fromkeys(names, self.config.prefill_tp_size)
        names = [f"decode-{j}" for j in range(self.config.num_decode_instances)]
        return dict.fromkeys(names, self.config.decode_tp_size)

    def _actors_of(self, prefix: str) -> dict[str, Any]:
        return {i: a for i, a in self.worker_actors.items() if i.startswith(prefix)}

    def _start_router(self) -> None:
        prefill, decode = self._actors_of("prefill-"), self._actors_of("decode-")
        tp_sizes = dict.fromkeys(prefill, self.config.prefill_tp_size)
        timeout_s = self.host.config.worker_timeout_s
        self._address = self.host.start(
            [RayHandle(i, Role.PREFILL, a, self.namespace, timeout_s) for i, a in prefill.items()],
            [RayHandle(i, Role.DECODE, a, self.namespace, timeout_s, tp_sizes)
             for i, a in decode.items()],
        )  # fmt: skip

    @property
    def metrics_port(self) -> int | None:
        return self.host.metrics_port

    @property
    def http_port(self) -> int | None:
        return self.host.http_port

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self.serving():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the router at {self._address} did not report SERVING within "
                    f"{self.config.start_timeout_s:.0f}s"
                )
            time.sleep(0.05)

    # --------------------------------------------------------------- status
    def serving(self, timeout_s: float = 2.0) -> bool:
        """True when the router's gRPC health check answers SERVING."""
        if not self._address:
            return False
        try:
            with self._channel() as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=self._metadata()
                )
        except grpc.RpcError:
            return False
        return bool(reply.status == _SERVING)

    def _channel(self) -> grpc.Channel:
        cert_file = self.config.router_config().tls_cert_file
        if cert_file is None:
            return grpc.insecure_channel(self._address)
        root = Path(cert_file).read_bytes()
        return grpc.secure_channel(self._address, grpc.ssl_channel_credentials(root))

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.config.router_config().auth_token
        return (("authorization", f"Bearer {token}"),) if token else ()

    def status(self, timeout_s: float = 5.0) -> ClusterStatus:
        """Every worker's health, load and KV usage, and the router's gRPC health."""
        workers = []
        for placement in self.placements:
            actor = self.worker_actors.get(placement.instance_id)
            status = WorkerStatus(placement.instance_id, placement.role, placement.tp_size, False)
            try:
                info, load = ray.get([actor.info.remote(), actor.load.remote()], timeout=timeout_s)
                status.node_ip, status.node_id = info["node_ip"], info["node_id"]
                status.pids, status.load = info["pids"], load
                status.healthy = bool(load.healthy)
            except Exception as exc:  # dead, restarting or stuck: say so, do not raise
                status.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0:1]}"
            workers.append(status)
        return ClusterStatus(self._address, self.serving(), workers, self.pids())

    def pids(self) -> list[int]:
        """Every live process of the Ray cluster this object started (empty when joined)."""
        return self._node.pids() if self._node is not None and self._node.owned else []

    # ------------------------------------------------------------- shutdown
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM: stop `serve_forever`; during `start`, interrupt it (it shuts down)."""

        def handle(signum: int, frame: Any) -> None:
            self.stop_signal = signum
            self._stop_requested.set()
            if not self._serving.is_set():
                raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handle)

    def serve_forever(self) -> int | None:
        """Serve until SIGINT or SIGTERM, then shut down; returns the signal number."""
        self.install_signal_handlers()
        self._serving.set()
        while not self._stop_requested.wait(0.5):
            pass
        self.shutdown()
        return self.stop_signal

    def shutdown(self, grace_s: float | None = None) -> None:
        """Graceful and idempotent: see the module docstring."""
        if self._closed:
            return
        self._closed = True
        grace = self.config.router_config().shutdown_grace_s if grace_s is None else grace_s
        if ray.is_initialized():
            self._stop_actors(grace)
            remove_placements(self.placements)
        if self._node is not None:
            survivors = self._node.stop(timeout_s=6.0)
            if survivors:
                logger.error("processes still running after shutdown: %s", survivors)

    def _stop_actors(self, grace_s: float) -> None:
        _best_effort(lambda: self.host.stop(grace_s))
        stops = [actor.shutdown.remote() for actor in self.worker_actors.values()]
        if stops:
            # after the drain, all of shutdown fits in ~15 s: workers 5, Ray's processes 6
            ray.wait(stops, num_returns=len(stops), timeout=5)
        for actor in [*self.worker_actors.values(), *self.rank_actors]:
            _best_effort(lambda a=actor: ray.kill(a, no_restart=True))

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _best_effort(run: Callable[[], Any]) -> None:
    try:
        run()
    except Exception as exc:
        logger.warning("shutdown step failed: %r", exc)
