"""Starting (or joining) Ray, and leaving nothing of it behind.

`start_local_ray` starts a one-node Ray cluster that listens on 127.0.0.1 only:

- Ray turns a loopback node address into a "remotely reachable" one (the first interface's
  address) unless `ENABLE_RAY_CLUSTER` is off, so it is switched off here, in this process's
  copy of the constant and (through the environment) in every process Ray starts. With the node
  address 127.0.0.1, the GCS, raylet, core-worker gRPC servers, the dashboard agent (HTTP, gRPC,
  metrics export), the runtime-env agent, the API server and the autoscaler monitor all bind
  127.0.0.1 (the C++ gRPC servers as IPv6 sockets bound to ::ffff:127.0.0.1, the IPv4-mapped
  loopback address); tests/deploy/test_ray_cluster.py checks every process of the cluster.
- No dashboard UI, a small object store (KV never travels through it), its own temp dir under
  /tmp, `num_cpus` from the machine.
- Ray's processes start in a session of their own. A signal to this process's group (systemd's
  stop, a terminal's Ctrl-C) then reaches only pdserve, which drains and stops Ray itself;
  otherwise the GCS and raylet die first and the driver cannot reach its own cluster to drain.
  They still die with this process (Ray sets PR_SET_PDEATHSIG on each of them).
- The GCS keeps no record per actor call: pdserve's actors are created with
  `enable_task_events=False` (a request makes several calls; with events on, the GCS grew by
  tens of MB per thousand requests), and `_GCS_SYSTEM_CONFIG` caps what is still recorded.

`LocalRay.stop()` runs `ray.shutdown()` and then makes sure every process that was a descendant
of this one when Ray was up (GCS, raylet, agents, workers) is gone, killing stragglers by id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

REPO_ROOT = Path(__file__).resolve().parents[3]  # deploy/runtime/ray/node.py
_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # control messages only
# Task events (actor creations, ray.get_actor lookups...) the GCS keeps: Ray's default, 100,000
# tasks, is a memory ceiling of ~100 MB that a long-running server reaches.
_GCS_SYSTEM_CONFIG = {"task_events_max_num_task_in_gcs": 2000}


def use_loopback_node_address() -> None:
    """Make Ray keep 127.0.0.1 as the node address (and so bind its servers there)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def worker_env_vars() -> dict[str, str]:
    """Environment for Ray's worker processes: pdserve and its generated stubs importable, and
    one torch thread unless the rank sets more."""
    paths = [str(REPO_ROOT), str(REPO_ROOT / "proto")]
    existing = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": os.pathsep.join(paths + ([existing] if existing else [])),
        "OMP_NUM_THREADS": "1",
    }


class _NewSessionPopen(subprocess.Popen):  # type: ignore[type-arg]
    """Popen that puts the child in a new session (and so a process group of its own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["start_new_session"] = True
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def ray_processes_in_own_session() -> Iterator[None]:
    """While open, the processes `ray.init` starts (GCS, raylet, agents; the raylet's workers
    inherit it) get a session of their own, out of reach of a signal to our process group.

    Ray has no option for this: it starts every process through `services.ConsolePopen`.
    """
    from ray._private import services

    original = services.ConsolePopen
    services.ConsolePopen = _NewSessionPopen  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        services.ConsolePopen = original  # type: ignore[misc]


def descendant_pids(root_pid: int) -> list[int]:
    """Every live process below `root_pid`, read from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found: list[int] = []
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def process_is_running(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_and_wait(pids: list[int], timeout_s: float) -> list[int]:
    """SIGTERM, then SIGKILL after half the timeout; returns the pids still running."""
    deadline = time.monotonic() + timeout_s
    for sig, until in ((signal.SIGTERM, deadline - timeout_s / 2), (signal.SIGKILL, deadline)):
        for pid in pids:
            if process_is_running(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        while time.monotonic() < until and any(process_is_running(p) for p in pids):
            time.sleep(0.05)
    return [pid for pid in pids if process_is_running(pid)]


@dataclass
class LocalRay:
    """A Ray cluster this process started (or joined, `owned=False`)."""

    owned: bool
    temp_dir: str | None = None
    known_pids: set[int] = field(default_factory=set)
    other_pids: set[int] = field(default_factory=set)  # children this process had before Ray

    def remember_processes(self) -> None:
        """Record Ray's processes (call while it runs: workers appear as actors start)."""
        if self.owned:
            self.known_pids.update(set(descendant_pids(os.getpid())) - self.other_pids)

    def pids(self) -> list[int]:
        self.remember_processes()
        return sorted(pid for pid in self.known_pids if process_is_running(pid))

    def stop(self, timeout_s: float = 20.0) -> list[int]:
        """Disconnect; for an owned cluster stop it and kill leftovers. Returns survivors."""
        self.remember_processes()
        if ray.is_initialized():
            ray.shutdown()
        if not self.owned:
            return []
        survivors = kill_and_wait(sorted(self.known_pids), timeout_s)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return survivors


def start_local_ray(
    namespace: str, num_cpus: int | None = None, num_gpus: int | None = None
) -> LocalRay:
    """A fresh one-node Ray cluster on 127.0.0.1 with its own temp dir (see the module doc).
    `num_gpus`: what the node offers (None: Ray counts them; tests declare GPUs there are not)."""
    use_loopback_node_address()
    other_pids = set(descendant_pids(os.getpid()))
    # Through the environment Ray's processes inherit, not a runtime_env: workers with a
    # runtime_env cannot come from Ray's prestarted pool (measured: 2.5 s vs 0.4 s per actor).
    os.environ.update(worker_env_vars())
    temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-", dir="/tmp")
    try:
        with ray_processes_in_own_session():
            ray.init(
                num_cpus=num_cpus or len(os.sched_getaffinity(0)),
                num_gpus=num_gpus,
                namespace=namespace,
                include_dashboard=False,
                object_store_memory=_OBJECT_STORE_BYTES,
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=temp_dir,
                _system_config=_GCS_SYSTEM_CONFIG,
            )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    node = LocalRay(owned=True, temp_dir=temp_dir, other_pids=other_pids)
    node.remember_processes()
    return node


def connect_ray(address: str, namespace: str) -> LocalRay:
    """Join an existing cluster (`ray start` / `ray up` / KubeRay); it stays up after us."""
    ray.init(
        address=address,
        namespace=namespace,
        runtime_env={"env_vars": worker_env_vars()},
        log_to_driver=False,
        configure_logging=False,
    )
    return LocalRay(owned=False)
