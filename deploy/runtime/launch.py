"""Pick the runtime for a config: Ray actors (deploy/runtime/ray/cluster.py) or plain processes.

    cluster = open_cluster(config, model_dir)      # RayCluster, or LocalCluster with ray off
    with cluster:
        address = cluster.start(progress=print)

Both runtimes take the same ClusterSpec (deploy/config/cluster_spec.py) and have the same surface,
deploy/runtime/router_host.ServingCluster: `start(progress) -> address`, `address`,
`metrics_port`, `http_port`, `serving()`, `shutdown()`, and use as a context manager.
`--no-ray` (or `ray.enabled: false`) asks for plain processes. Every mode (disaggregated,
colocated, adaptive) runs on both.
"""

from __future__ import annotations

from collections.abc import Callable

from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import ServeConfig
from deploy.runtime.local.local_cluster import LocalCluster
from deploy.runtime.router_host import ServingCluster


def open_cluster(
    config: ServeConfig, model_dir: str, say: Callable[[str], None] = print
) -> ServingCluster:
    """A cluster for `config` (not started yet), on Ray unless `config.ray.enabled` is off."""
    if not config.ray.enabled:
        return LocalCluster(build_cluster_spec(config, model_dir))
    from deploy.runtime.ray.cluster import RayCluster  # imports ray: only when asked for

    return RayCluster(build_cluster_spec(config, model_dir))
