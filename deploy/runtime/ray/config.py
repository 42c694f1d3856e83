"""What a RayCluster is built from (one frozen dataclass), and what `status()` reports.

The YAML config and the command line (deploy/config/serve_config.py, deploy/cli/main.py) become a ClusterSpec
(deploy/config/cluster_spec.py), the same one plain processes run; `RayClusterConfig.from_cluster_spec`
takes its role configs and router config whole, so both runtimes serve with the same limits.
Built field by field (tests, scripts), the worker and router configs are derived here, so
prefill, decode and router always agree on block size, model length and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decode_worker.config import DecodeConfig
from engine.config import EngineConfig
from engine.messages import InstanceLoad, Role
from kv_transfer.config import KVTransferConfig
from prefill_worker.config import PrefillConfig
from router.config import RouterConfig

if TYPE_CHECKING:
    from deploy.config.cluster_spec import ClusterSpec


@dataclass(frozen=True)
class RayClusterConfig:
    """A disaggregated cluster on Ray.

    `address=None` starts a local Ray cluster on 127.0.0.1 (its own temp dir, no dashboard,
    `num_cpus` from the machine unless given); otherwise it joins that cluster ("auto",
    "ray://..." or "host:port"). `num_cpus_per_worker=None` shares the cluster's CPUs among the
    workers (at most 1 each). `prefill_resources` / `decode_resources` are custom Ray resources
    added to each worker's bundle (e.g. {"prefill_node": 0.01}) to pin roles to node groups.
    `max_restarts`: how often Ray restarts a worker actor that died; -1 (the default): always,
    as the plain-process runtime does (a limit would leave the instance down for good).
    `router`, `prefill`, `decode`: when given (from_cluster_spec), used as they are in place of
    the configs the flat fields would build.
    """

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    num_prefill_instances: int = 1
    prefill_tp_size: int = 1
    num_decode_instances: int = 1
    decode_tp_size: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    prefill_policy: str = "least_tokens"
    decode_policy: str = "most_free_blocks"
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_running_requests: int = 256
    max_queued_requests: int = 256
    shutdown_grace_s: float = 5.0
    worker_timeout_s: float = 10.0
    kv_transfer_timeout_s: float = 30.0
    kv_start_timeout_s: float = 60.0  # a decode reservation's wait for its prefill to start sending
    address: str | None = None
    num_cpus: int | None = None
    num_cpus_per_worker: float | None = None
    pin_cpus: bool = True
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = -1
    start_timeout_s: float = 180.0
    router: RouterConfig | None = None
    prefill: PrefillConfig | None = None
    decode: DecodeConfig | None = None

    def __post_init__(self) -> None:
        counts = {
            "num_prefill_instances": self.num_prefill_instances,
            "prefill_tp_size": self.prefill_tp_size,
            "num_decode_instances": self.num_decode_instances,
            "decode_tp_size": self.decode_tp_size,
        }
        for name, value in counts.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_cpus_per_worker is not None and not self.num_cpus_per_worker > 0:
            raise ValueError(f"num_cpus_per_worker must be > 0, got {self.num_cpus_per_worker!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(f"max_restarts must be an integer >= -1, got {self.max_restarts!r}")
        for name in ("prefill_resources", "decode_resources"):
            for key, amount in getattr(self, name).items():
                if not isinstance(key, str) or not amount > 0:
                    raise ValueError(f"{name}[{key!r}] must be a positive amount, got {amount!r}")
        self.engine_config(1)  # the engine and router check the rest, with their own messages
        self.router_config()

    @classmethod
    def from_cluster_spec(cls, spec: ClusterSpec, **ray_options: object) -> RayClusterConfig:
        """The spec's role configs and router config, as they are (`ray_options`: address,
        max_restarts, ... the fields no spec holds)."""
        if spec.is_colocated or spec.prefill is None or spec.decode is None:
            raise ValueError("a Ray cluster runs the disaggregated layout only")
        engine = spec.prefill.engine
        options: dict = {"address": spec.ray_address, "pin_cpus": spec.pin_cpus, **ray_options}
        return cls(
            model_dir=spec.model_dir, dtype=engine.dtype, device=engine.device,
            num_prefill_instances=spec.num_prefill_instances,
            prefill_tp_size=engine.tensor_parallel_size,
            num_decode_instances=spec.num_decode_instances,
            decode_tp_size=spec.decode.engine.tensor_parallel_size,
            block_size=engine.block_size, max_model_len=engine.max_model_len,
            router=spec.router, prefill=spec.prefill, decode=spec.decode, **options,
        )  # fmt: skip

    @property
    def num_workers(self) -> int:
        return (
            self.num_prefill_instances * self.prefill_tp_size
            + self.num_decode_instances * self.decode_tp_size
        )

    def engine_config(self, tp_size: int) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir, dtype=self.dtype, device=self.device,
            tensor_parallel_size=tp_size, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunk_size, enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=self.max_model_len,
        )  # fmt: skip

    def kv_transfer_config(self) -> KVTransferConfig:
        return KVTransferConfig(
            transfer_timeout_s=self.kv_transfer_timeout_s, start_timeout_s=self.kv_start_timeout_s
        )

    def prefill_config(self) -> PrefillConfig:
        if self.prefill is not None:
            return self.prefill
        return PrefillConfig(self.engine_config(self.prefill_tp_size), self.kv_transfer_config())

    def decode_config(self) -> DecodeConfig:
        if self.decode is not None:
            return self.decode
        return DecodeConfig(self.engine_config(self.decode_tp_size), self.kv_transfer_config())

    def router_config(self) -> RouterConfig:
        if self.router is not None:
            return self.router
        return RouterConfig(
            model_dir=self.model_dir, host=self.host, port=self.port,
            metrics_port=self.metrics_port, tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file, auth_token=self.auth_token,
            max_model_len=self.max_model_len, block_size=self.block_size,
            prefill_policy=self.prefill_policy, decode_policy=self.decode_policy,
            max_running_requests=self.max_running_requests,
            max_queued_requests=self.max_queued_requests,
            worker_timeout_s=self.worker_timeout_s, shutdown_grace_s=self.shutdown_grace_s,
        )  # fmt: skip


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
    serving: bool  # gRPC health of the router
    workers: list[WorkerStatus]
    ray_pids: list[int]  # every process of the local Ray cluster (empty when joined)
