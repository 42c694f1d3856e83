"""Pick the runtime for a ClusterSpec: Ray actors (deploy/ray_cluster.py) or plain processes.

Both runtimes have the same surface: `start(progress) -> address`, `address`, `metrics_port`,
`shutdown()`, and use as a context manager. `pdserve serve` and `pdserve demo` call
`open_cluster`; `--no-ray` (or `ray.enabled: false`) asks for plain processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from deploy.cluster_spec import ClusterSpec
from deploy.local_cluster import LocalCluster


class Cluster(Protocol):
    """What the command line needs from a running cluster."""

    @property
    def address(self) -> str: ...

    def start(self, progress: Callable[[str], None] | None = None) -> str: ...

    def shutdown(self) -> None: ...


def ray_runtime_available() -> bool:
    try:
        import deploy.ray_cluster  # noqa: F401
    except ImportError:
        return False
    return True


def open_cluster(
    spec: ClusterSpec, use_ray: bool, say: Callable[[str], None] = print
) -> Cluster | Any:
    """A cluster object for `spec`, not started yet."""
    if use_ray:
        if ray_runtime_available():
            from deploy.ray_cluster import RayCluster

            return RayCluster.from_spec(spec)  # type: ignore[attr-defined]
        say("the Ray runtime (deploy/ray_cluster.py) is not available: running plain processes")
    return LocalCluster(spec)
