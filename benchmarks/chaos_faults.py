"""The chaos benchmark's faults, the check that the cluster healed after each, and process RSS.

Targets are found through the cluster's own handles (the worker processes and the TP ranks
they spawned, `ProcessIds`), never by scanning for process names.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from deploy.runtime.local.local_cluster import LocalCluster
from worker.protocol import ProcessIds

FAULTS = ("kill_decode", "kill_prefill_rank", "stop_worker", "drop_kv_channel")
HEAL_TIMEOUT_S = 120.0
DECODES = ("decode-0", "decode-1")


class Faults:
    def __init__(
        self,
        cluster: LocalCluster,
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
            "kill_decode": self._kill_decode,
            "kill_prefill_rank": self._kill_prefill_rank,
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

    def _kill_decode(self) -> dict[str, Any]:
        instance_id = self._rng.choice(DECODES)
        pid = self._cluster.workers[instance_id].pid
        os.kill(pid, signal.SIGKILL)
        return {"target": instance_id, "pid": pid}

    def _kill_prefill_rank(self) -> dict[str, Any]:
        pids = self._cluster.workers["prefill-0"].call(ProcessIds(), timeout_s=10.0)
        rank = self._rng.randrange(len(pids))
        os.kill(pids[rank], signal.SIGKILL)
        return {"target": f"prefill-0 rank {rank}", "pid": pids[rank]}

    def _stop_worker(self) -> dict[str, Any]:
        instance_id = self._rng.choice(("prefill-0", *DECODES))
        pid = self._cluster.workers[instance_id].pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(self._stop_s, _continue, args=(pid,)).start()
        time.sleep(self._stop_s + 0.1)
        return {"target": instance_id, "pid": pid, "stopped_s": self._stop_s}

    def _drop_kv_channel(self) -> dict[str, Any]:
        prefill = set(self._cluster.workers["prefill-0"].call(ProcessIds(), timeout_s=10.0))
        decode = {self._cluster.workers[i].pid: i for i in DECODES}
        links = _tcp_links(prefill, set(decode))
        if not links:
            raise RuntimeError("no TCP connection between a prefill rank and a decode worker")
        local, remote, owner = self._rng.choice(links)
        done = subprocess.run(
            ["ss", "-K", "-tn", "src", local, "dst", remote],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode != 0 or local.split(":")[1] not in done.stdout:
            raise RuntimeError(f"ss -K could not abort {local} -> {remote}: {done.stderr.strip()}")
        return {"target": f"{local} -> {remote} ({decode[owner]})"}

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
            loads = self._cluster.status()
        except Exception:
            return False
        router = self._cluster.router
        if router is None or not all(load.healthy for load in loads):
            return False
        pool = router.pool
        routable = {s.instance_id for s in [*pool.prefill_candidates(), *pool.decode_candidates()]}
        return routable == {load.instance_id for load in loads} and self._serving()


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


def rss_by_kind(cluster: LocalCluster) -> dict[str, float]:
    """Mean resident memory (MiB) per process kind: the router's (this process), the prefill
    ranks', the decode workers'. Means, so a restarted process compares with its kind."""
    kinds = {
        "router": [os.getpid()],
        "prefill": cluster.workers["prefill-0"].call(ProcessIds(), timeout_s=10.0),
        "decode": [cluster.workers[i].pid for i in DECODES],
    }
    rss: dict[str, float] = {}
    for kind, pids in kinds.items():
        sizes = [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]
        rss[kind] = round(sum(sizes) / len(sizes), 1)
    return rss
