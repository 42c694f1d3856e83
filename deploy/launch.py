"""Pick the runtime for a config: Ray actors (deploy/ray_cluster.py) or plain processes.

    cluster = open_cluster(config, model_dir)      # RayCluster, or LocalCluster with ray off
    with cluster:
        address = cluster.start(progress=print)

Both runtimes have the same surface: `start(progress) -> address`, `address`, `shutdown()`,
and use as a context manager. `--no-ray` (or `ray.enabled: false`) asks for plain processes;
the colocated layout (a baseline for benchmarks) runs only as plain processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from deploy.cluster_spec import build_cluster_spec
from deploy.config import ConfigError, ServeConfig
from deploy.local_cluster import LocalCluster

if TYPE_CHECKING:
    from deploy.ray_config import RayClusterConfig


class Cluster(Protocol):
    """What the command line needs from a cluster (LocalCluster and RayCluster have it)."""

    @property
    def address(self) -> str: ...

    def start(self, progress: Callable[[str], None] | None = None) -> str: ...

    def shutdown(self) -> None: ...

    def __enter__(self) -> Cluster: ...

    def __exit__(self, *exc_info: object) -> None: ...


def ray_cluster_config(config: ServeConfig, model_dir: str) -> RayClusterConfig:
    """The config file, field by field, as deploy/ray_config.RayClusterConfig."""
    from deploy.ray_config import RayClusterConfig

    if config.mode != "disaggregated":
        raise ConfigError(
            f"mode {config.mode!r} runs as plain processes only: set ray.enabled: false "
            "(or pass --no-ray)"
        )
    router = config.router
    return RayClusterConfig(
        model_dir=model_dir,
        dtype=config.dtype,
        device=config.device,
        num_prefill_instances=config.prefill.instances,
        prefill_tp_size=config.prefill.tensor_parallel_size,
        num_decode_instances=config.decode.instances,
        decode_tp_size=config.decode.tensor_parallel_size,
        block_size=config.kv_cache.block_size,
        num_kv_blocks=config.kv_cache.num_blocks,
        kv_cache_memory_bytes=config.kv_cache.memory_mb * 1024 * 1024,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        chunk_size=config.scheduler.chunk_size,
        prefill_policy=config.prefill.policy,
        decode_policy=config.decode.policy,
        host=router.host,
        port=router.port,
        metrics_port=router.metrics_port,
        auth_token=router.resolved_auth_token(),
        tls_cert_file=router.tls_cert_file,
        tls_key_file=router.tls_key_file,
        address=config.ray.address,
        pin_cpus=config.pin_cpus,
    )


def open_cluster(
    config: ServeConfig, model_dir: str, say: Callable[[str], None] = print
) -> Cluster:
    """A cluster for `config` (not started yet), on Ray unless `config.ray.enabled` is off."""
    if config.ray.enabled:
        from deploy.ray_cluster import RayCluster

        return RayCluster(ray_cluster_config(config, model_dir))
    return LocalCluster(build_cluster_spec(config, model_dir=model_dir))


def cluster_metrics_port(cluster: Cluster) -> int | None:
    """The port the router serves /metrics on (None: metrics are off)."""
    port = getattr(cluster, "metrics_port", None)
    router_actor = getattr(cluster, "router_actor", None)
    if port is None and router_actor is not None:  # RayCluster: ask the router's actor
        import ray

        port = ray.get(router_actor.metrics_port.remote(), timeout=30)
    return port
