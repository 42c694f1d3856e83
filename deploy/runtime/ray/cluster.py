"""RayCluster: the one object the command line uses to run pdserve on Ray.

    with RayCluster(build_cluster_spec(config)) as c:     # the ClusterSpec plain processes take
        address = c.start(progress=print)      # "127.0.0.1:50123", health SERVING
        c.status()                             # workers, loads, KV usage, health
    # shutdown(): drain, stop the actors, remove the placement groups, stop Ray

Start-up, in order (each step reported through `progress`):
1. Ray: a local cluster on 127.0.0.1 (deploy/runtime/ray/node.py), or join `spec.ray.address`.
2. Placement groups for any layout (deploy/runtime/ray/placement.py): an instance at TP>1
   packed on one node, the TP=1 replicas of a role spread; GPUs or CPU shares as resources.
3. Worker actors (deploy/runtime/ray/actors.py), all at once: each loads the model, forms its TP group
   (rank actors via deploy/runtime/ray/launcher.py) and opens its KV channel endpoints. Ports travel as
   actor-call arguments and results (RankSpec, KVTicket); KV itself never enters Ray.
4. KV channels: a two-token request through every pair (ClusterSpec.kv_pairs; none when
   colocated) builds its channels before the first user request.
5. The router, in this process (deploy/runtime/router_host.py) with a RayHandle per worker actor; then
   wait until its health is SERVING.

Failures: a worker actor whose process dies is restarted by Ray (`ray.max_restarts`) behind the
same name and handle (its in-flight requests: docs/design/recovery.md). The router avoids it until
its load reports healthy, once its constructor rebuilt the worker and its KV pair channels
(deploy/runtime/channels.py). A restarted driver replaces its TP rank actors (launcher.py).

Shutdown (`shutdown()`; `pdserve serve` calls it on SIGINT/SIGTERM): the router stops
admitting and gives in-flight requests `shutdown_grace_s`, then aborts them; the workers shut
down (freeing every block, ending their TP ranks); every actor is killed, the placement groups
removed, and a Ray cluster that this object started is stopped with every one of its
processes, checked by process id.
"""

from __future__ import annotations

import functools
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.channels import form_all_channels
from deploy.runtime.ray.actors import WorkerActor
from deploy.runtime.ray.handles import RayHandle, actor_call, actor_name
from deploy.runtime.ray.launcher import rank_actor_name, start_rank_actors
from deploy.runtime.ray.node import LocalRay, connect_ray, start_local_ray
from deploy.runtime.ray.placement import (
    InstancePlacement,
    PlacementPlan,
    PlannedInstance,
    gpus_per_rank,
    place_instances,
    remove_placements,
    wait_until_placed,
)
from deploy.runtime.router_host import Progress, ServingCluster
from worker.protocol import InstanceLoad, Load, Role

logger = logging.getLogger(__name__)


@dataclass
class WorkerStatus:
    """One worker instance as `RayCluster.status()` sees it."""

    instance_id: str
    role: Role
    tp_size: int
    healthy: bool
    node_ip: str = ""
    node_id: str = ""
    pids: list[int] = field(default_factory=list)
    load: InstanceLoad | None = None  # None when the actor did not answer
    error: str | None = None


@dataclass
class ClusterStatus:
    router_address: str
    serving: bool  # the router's health
    workers: list[WorkerStatus]
    ray_pids: list[int]  # every process of the local Ray cluster (empty when joined)


class RayCluster(ServingCluster):
    """The ClusterSpec on Ray: `spec.ray` holds what only this runtime reads."""

    def __init__(self, spec: ClusterSpec, start_timeout_s: float = 180.0) -> None:
        super().__init__(spec, start_timeout_s)
        self.namespace = f"pdserve-{uuid.uuid4().hex[:8]}"
        self.placements: list[InstancePlacement] = []
        self.worker_actors: dict[str, Any] = {}
        self.rank_actors: list[Any] = []  # TP ranks 1..k-1 (a restarted driver makes its own)
        self._node: LocalRay | None = None

    @property
    def temp_dir(self) -> str | None:
        """The temp dir of the local Ray cluster this object started (None when joined)."""
        return None if self._node is None else self._node.temp_dir

    # ---------------------------------------------------------------- start
    def _start(self, say: Progress) -> None:
        address = self.spec.ray.address
        say("starting Ray" if address is None else f"joining Ray at {address}")
        self._start_ray()
        if self.temp_dir is not None:
            say(f"Ray temp dir {self.temp_dir}")
        for message, run in [
            (f"reserving {self.spec.num_workers} workers", self._place),
            ("loading the model on every worker", self._start_workers),
            ("forming the KV channels", self._form_kv_channels),
            ("starting the router", self._start_router),
        ]:
            say(message)
            run()
            assert self._node is not None
            self._node.remember_processes()  # Ray's new processes, to stop them by id at shutdown

    def _start_ray(self) -> None:
        if self.spec.ray.address is None:
            self._node = start_local_ray(self.namespace, self.spec.ray.num_cpus)
        else:
            self._node = connect_ray(self.spec.ray.address, self.namespace)

    def placement_plan(self, cluster_cpus: float, cluster_gpus: float = 0.0) -> PlacementPlan:
        """Where the workers go. Unless `ray.num_cpus_per_worker` is set, they share the
        cluster's `cluster_cpus` (2 cores and 4 workers: 0.5 each, at most 1). Ranks share the
        cluster's GPUs where the same-node transport allows it (placement.gpus_per_rank)."""
        spec, options = self.spec, self.spec.ray
        cpus = options.num_cpus_per_worker
        if cpus is None:
            cpus = max(0.01, min(1.0, math.floor(100 * cluster_cpus / spec.num_workers) / 100))
        resources = {
            Role.PREFILL: options.prefill_resources,
            Role.DECODE: options.decode_resources,
            Role.COLOCATED: options.colocated_resources,
            Role.ADAPTIVE: options.adaptive_resources,
        }
        instances = spec.instances()
        tp_sizes = [i.config.engine.tensor_parallel_size for i in instances]
        return PlacementPlan(
            tuple(
                PlannedInstance(i.instance_id, i.role, tp, dict(resources[i.role]))
                for i, tp in zip(instances, tp_sizes, strict=True)
            ),
            instances[0].config.engine.device,
            cpus,
            # one kv_transfer section for every instance (colocated ones move no KV)
            gpus_per_rank(instances[0].config.kv_transfer.transport, tp_sizes, cluster_gpus),
        )

    def _place(self) -> None:
        resources = ray.cluster_resources()
        plan = self.placement_plan(resources.get("CPU", 1.0), resources.get("GPU", 0.0))
        self.placements = place_instances(plan, f"{self.namespace}-")
        wait_until_placed(self.placements, self.start_timeout_s)

    def actor_options(self) -> dict[str, Any]:
        """The Ray options of every worker actor, beside its placement."""
        return {
            "max_concurrency": 64,
            # Every request makes several calls (submit, reserve, polls, deliver) and the GCS
            # would keep an event record of each: memory grew per request served.
            "enable_task_events": False,
            "max_restarts": self.spec.ray.max_restarts,
            "max_task_retries": 0,
        }

    def _start_workers(self) -> None:
        remote = ray.remote(WorkerActor)
        pin, num_workers, configs = self.spec.pin_cpus, self.spec.num_workers, self.worker_configs()
        for placement in self.placements:
            self.rank_actors.extend(start_rank_actors(placement, num_workers, pin, named=True))
            ranks = [rank_actor_name(placement.instance_id, r) for r in range(1, placement.tp_size)]
            self.worker_actors[placement.instance_id] = remote.options(
                name=actor_name(placement.instance_id),
                num_cpus=placement.num_cpus,
                num_gpus=placement.num_gpus,
                scheduling_strategy=placement.strategy(0),
                **self.actor_options(),
            ).remote(
                configs[placement.instance_id],
                placement,
                num_workers,
                pin,
                self.namespace,
                ranks,
                self.spec.kv_peers(placement.instance_id),
            )
        infos = [actor.info.remote() for actor in self.worker_actors.values()]
        ray.get(infos, timeout=self.start_timeout_s)  # built: ready

    def _form_kv_channels(self) -> None:
        pairs = self.spec.kv_pairs()
        if not pairs:
            return  # colocated: no KV moves
        prefill_tp = {p: self.spec.worker_config(p).engine.tensor_parallel_size for p, _ in pairs}
        timeout_s = self.spec.worker_config(pairs[0][0]).kv_transfer.transfer_timeout_s + 10
        form_all_channels(pairs, prefill_tp, actor_call(self.namespace, timeout_s), timeout_s)

    def _handle(self, instance_id: str, role: Role, prefill_tp: dict[str, int]) -> RayHandle:
        actor, timeout_s = self.worker_actors[instance_id], self.spec.router.worker_timeout_s
        return RayHandle(instance_id, role, actor, self.namespace, timeout_s, prefill_tp)

    # --------------------------------------------------------------- status
    def status(self, timeout_s: float = 5.0) -> ClusterStatus:
        """Every worker's health, load and KV usage, and the router's health."""
        workers = []
        for placement in self.placements:
            actor = self.worker_actors.get(placement.instance_id)
            status = WorkerStatus(placement.instance_id, placement.role, placement.tp_size, False)
            try:
                if actor is None:
                    raise RuntimeError("never started")
                calls = [actor.info.remote(), actor.call.remote(Load())]
                info, load = ray.get(calls, timeout=timeout_s)
                status.node_ip, status.node_id = info["node_ip"], info["node_id"]
                status.pids, status.load = info["pids"], load
                status.healthy = bool(load.healthy)
            except Exception as exc:  # dead, restarting or stuck: say so, do not raise
                status.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0:1]}"
            workers.append(status)
        return ClusterStatus(self.address, self.serving(), workers, self.pids())

    def pids(self) -> list[int]:
        """Every live process of the Ray cluster this object started (empty when joined)."""
        return self._node.pids() if self._node is not None and self._node.owned else []

    # ------------------------------------------------------------- shutdown
    def _stop_workers(self) -> None:
        if ray.is_initialized():
            stops = [actor.shutdown.remote() for actor in self.worker_actors.values()]
            if stops:
                # after the drain, all of shutdown fits in ~15 s: workers 5, Ray's processes 6
                ray.wait(stops, num_returns=len(stops), timeout=5)
            for actor in [*self.worker_actors.values(), *self.rank_actors]:
                _best_effort(functools.partial(ray.kill, actor, no_restart=True))
            remove_placements(self.placements)
        if self._node is not None:
            survivors = self._node.stop(timeout_s=6.0)
            if survivors:
                logger.error("processes still running after shutdown: %s", survivors)


def _best_effort(run: Callable[[], Any]) -> None:
    try:
        run()
    except Exception as exc:
        logger.warning("shutdown step failed: %r", exc)
