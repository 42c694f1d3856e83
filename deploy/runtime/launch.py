"""Pick the runtime for a config: Ray actors (deploy/runtime/ray/cluster.py) or plain processes.

    cluster = open_cluster(config, model_dir)      # RayCluster, or LocalCluster with ray off
    with cluster:
        address = cluster.start(progress=print)

Both runtimes have the same surface: `start(progress) -> address`, `address`, `metrics_port`,
`http_port`, `shutdown()`, and use as a context manager. `--no-ray` (or `ray.enabled: false`) asks for plain processes;
the colocated layout (a baseline for benchmarks) runs only as plain processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import ConfigError, ServeConfig
from deploy.runtime.local.local_cluster import LocalCluster

if TYPE_CHECKING:
    from deploy.runtime.ray.config import RayClusterConfig


class Cluster(Protocol):
    """What the command line needs from a cluster (LocalCluster and RayCluster have it)."""

    @property
    def address(self) -> str: ...

    @property
    def metrics_port(self) -> int | None: ...

    @property
    def http_port(self) -> int | None: ...

    def start(self, progress: Callable[[str], None] | None = None) -> str: ...

    def shutdown(self) -> None: ...

    def __enter__(self) -> Cluster: ...

    def __exit__(self, *exc_info: object) -> None: ...


def ray_cluster_config(config: ServeConfig, model_dir: str) -> RayClusterConfig:
    """The config file as deploy/runtime/ray/config.RayClusterConfig: the ClusterSpec plain processes
    run, with its role and router configs taken whole."""
    from deploy.runtime.ray.config import RayClusterConfig

    if config.mode != "disaggregated":
        raise ConfigError(
            f"mode {config.mode!r} runs as plain processes only: set ray.enabled: false "
            "(or pass --no-ray)"
        )
    return RayClusterConfig.from_cluster_spec(build_cluster_spec(config, model_dir))


def open_cluster(
    config: ServeConfig, model_dir: str, say: Callable[[str], None] = print
) -> Cluster:
    """A cluster for `config` (not started yet), on Ray unless `config.ray.enabled` is off."""
    if config.ray.enabled:
        from deploy.runtime.ray.cluster import RayCluster

        return RayCluster(ray_cluster_config(config, model_dir))
    return LocalCluster(build_cluster_spec(config, model_dir=model_dir))
