"""The chaos benchmark's faults, the check that the cluster healed after each, and process RSS.

Targets are found through the cluster's own view of its instances (`instances`: each one's
process ids, rank 0 first: ProcessIds for plain processes, the actors' `info` under Ray), never
by scanning for process names. Which faults apply follows from the layout (`faults_for`): a TP
rank to kill needs an instance at TP>1, a KV channel to drop needs a pair that hands KV off.
Under Ray, a dropped connection between a KV source's and a KV target's processes may be one of
Ray's own (actor calls) rather than a KV channel's; both must heal.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from deploy.runtime.local.local_cluster import LocalCluster
from deploy.runtime.router_host import ServingCluster
from worker.protocol import InstanceLoad, ProcessIds, Role, WorkerUnavailable

FAULTS = ("kill_worker", "kill_tp_rank", "stop_worker", "drop_kv_channel")
HEAL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Instance:
    instance_id: str
    role: Role
    pids: list[int]  # rank 0 (the worker process or actor) first


def instances(cluster: ServingCluster) -> list[Instance]:
    """Every instance with its processes, under either runtime."""
    if isinstance(cluster, LocalCluster):
        found = []
        for instance_id, worker in list(cluster.workers.items()):
            try:
                pids = worker.call(ProcessIds(), timeout_s=10.0)
            except WorkerUnavailable:
                pids = [worker.pid]
            found.append(Instance(instance_id, cluster.spec.instance(instance_id).role, pids))
        return found
    return [Instance(w.instance_id, w.role, w.pids) for w in _ray_workers(cluster)]


def loads(cluster: ServingCluster) -> list[InstanceLoad]:
    """Every instance's load; one that does not answer reports unhealthy."""
    if isinstance(cluster, LocalCluster):
        return cluster.status()
    return [
        w.load or InstanceLoad(w.instance_id, w.role, healthy=False) for w in _ray_workers(cluster)
    ]


def _ray_workers(cluster: ServingCluster) -> list[Any]:
    from deploy.runtime.ray.cluster import RayCluster  # imports ray: only under Ray

    assert isinstance(cluster, RayCluster)
    return cluster.status().workers


def faults_for(cluster: ServingCluster) -> tuple[str, ...]:
    spec = cluster.spec
    tp_sizes = [i.config.engine.tensor_parallel_size for i in spec.instances()]
    return tuple(
        kind
        for kind in FAULTS
        if (kind != "kill_tp_rank" or max(tp_sizes) > 1)
        and (kind != "drop_kv_channel" or spec.kv_pairs())
    )


class Faults:
    def __init__(
        self,
        cluster: ServingCluster,
        serving: Callable[[], bool],
        rng: random.Random,
        kv_deadline_s: float,
    ) -> None:
        self._cluster = cluster
        self._serving = serving
        self._rng = rng
        self._stop_s = kv_deadline_s + 2.0  # longer than every deadline a peer waits with
        self.log: list[dict[str, Any]] = []
        self._began = time.monotonic()
        self._faults: dict[str, Callable[[], dict[str, Any]]] = {
            "kill_worker": self._kill_worker,
            "kill_tp_rank": self._kill_tp_rank,
            "stop_worker": self._stop_worker,
            "drop_kv_channel": self._drop_kv_channel,
        }
        assert tuple(self._faults) == FAULTS

    def inject(self, kind: str) -> None:
        entry: dict[str, Any] = {"kind": kind, "t": round(time.monotonic() - self._began, 1)}
        try:
            entry.update(self._faults[kind]())
            entry["injected"] = True
        except Exception as exc:  # a fault that could not be made is reported, not fatal
            entry.update(injected=False, error=repr(exc)[:200])
        if entry["injected"]:
            entry["heal_s"], entry["healed"] = self._wait_healed()
        self.log.append(entry)
        print(f"[chaos] {entry}", flush=True)

    # -- the faults (each returns what it hit) -----------------------------------------------

    def _pick(self, role: Role | None = None, min_tp: int = 1) -> Instance:
        spec = self._cluster.spec
        candidates = [
            i
            for i in instances(self._cluster)
            if (role is None or i.role == role)
            and spec.worker_config(i.instance_id).engine.tensor_parallel_size >= min_tp
            and i.pids
        ]
        if not candidates:
            raise RuntimeError(f"no running instance (role {role}, TP >= {min_tp})")
        return self._rng.choice(candidates)

    def _kill_worker(self) -> dict[str, Any]:
        """A decode instance's worker (any instance's when there are no decode instances)."""
        decodes = self._cluster.spec.instance_ids(Role.DECODE)
        target = self._pick(Role.DECODE if decodes else None)
        os.kill(target.pids[0], signal.SIGKILL)
        return {"target": target.instance_id, "pid": target.pids[0]}

    def _kill_tp_rank(self) -> dict[str, Any]:
        target = self._pick(min_tp=2)
        rank = self._rng.randrange(len(target.pids))
        os.kill(target.pids[rank], signal.SIGKILL)
        return {"target": f"{target.instance_id} rank {rank}", "pid": target.pids[rank]}

    def _stop_worker(self) -> dict[str, Any]:
        target = self._pick()
        pid = target.pids[0]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(self._stop_s, _continue, args=(pid,)).start()
        time.sleep(self._stop_s + 0.1)
        return {"target": target.instance_id, "pid": pid, "stopped_s": self._stop_s}

    def _drop_kv_channel(self) -> dict[str, Any]:
        """A TCP connection from a KV source's ranks to a KV target's processes."""
        by_id = {i.instance_id: i for i in instances(self._cluster)}
        links = []
        for source, target in self._cluster.spec.kv_pairs():
            owners = {pid: target for pid in by_id[target].pids}
            for local, remote, owner in _tcp_links(set(by_id[source].pids), set(owners)):
                links.append((local, remote, f"{source} -> {owners[owner]}"))
        if not links:
            raise RuntimeError("no TCP connection between a KV source and its target")
        local, remote, pair = self._rng.choice(links)
        done = subprocess.run(
            ["ss", "-K", "-tn", "src", local, "dst", remote],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode != 0 or local.split(":")[1] not in done.stdout:
            raise RuntimeError(f"ss -K could not abort {local} -> {remote}: {done.stderr.strip()}")
        return {"target": f"{local} -> {remote} ({pair})"}

    # -- healing -------------------------------------------------------------------------------

    def _wait_healed(self) -> tuple[float, bool]:
        """Seconds until every instance is healthy and routable and health says SERVING."""
        began = time.monotonic()
        time.sleep(0.5)  # let the fault be noticed before asking whether it is over
        while time.monotonic() - began < HEAL_TIMEOUT_S:
            if self._healed():
                return round(time.monotonic() - began, 2), True
            time.sleep(0.2)
        return round(time.monotonic() - began, 2), False

    def _healed(self) -> bool:
        try:
            reports = loads(self._cluster)
        except Exception:
            return False
        router = self._cluster.router
        if router is None or not all(load.healthy for load in reports):
            return False
        pool = router.pool
        routable = {s.instance_id for s in [*pool.prefill_candidates(), *pool.decode_candidates()]}
        return routable == {load.instance_id for load in reports} and self._serving()


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _tcp_links(prefill_pids: set[int], decode_pids: set[int]) -> list[tuple[str, str, int]]:
    """(local, remote, decode pid) of each established TCP connection from a prefill rank to a
    decode worker, as ss writes addresses."""
    ports: dict[tuple[str, int], int] = {}
    for pid in decode_pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_ESTABLISHED and conn.laddr:
                ports[(conn.laddr.ip, conn.laddr.port)] = pid
    links = []
    for pid in prefill_pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr:
                continue
            owner = ports.get((conn.raddr.ip, conn.raddr.port))
            if owner is not None:
                local = f"{conn.laddr.ip}:{conn.laddr.port}"
                links.append((local, f"{conn.raddr.ip}:{conn.raddr.port}", owner))
    return links


def rss_by_kind(cluster: ServingCluster) -> dict[str, float]:
    """Mean resident memory (MiB) per process kind: the router's (this process), and each
    role's processes (prefill, decode, colocated, adaptive: every TP rank). Means, so a
    restarted process compares with its kind."""
    kinds: dict[str, list[int]] = {"router": [os.getpid()]}
    for instance in instances(cluster):
        kinds.setdefault(instance.role.value, []).extend(instance.pids)
    rss: dict[str, float] = {}
    for kind, pids in kinds.items():
        sizes = [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]
        if sizes:
            rss[kind] = round(sum(sizes) / len(sizes), 1)
    return rss
