"""What a cluster is made of, as the role configs the workers and the router take.

    spec = build_cluster_spec(load_config(path))   # resolves "demo" to the local demo model
    LocalCluster(spec) / RayCluster(spec)          # both start exactly this

The config file (deploy/config/serve_config.py) is the user's language; a ClusterSpec is the
code's: one WorkerConfig per role (its engine with the file's KV, scheduler, dtype and TP
settings, and the KV hand-off's deadlines), the RouterConfig, and the Ray runtime's own settings
(unused by plain processes).
Every knob is declared once, in the file's sections; this module is the one translator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deploy.config.models import resolve_model
from deploy.config.serve_config import RaySection, ServeConfig
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig
from kv_transfer.config import KVTransferConfig
from router.config import RouterConfig
from worker.config import WorkerConfig
from worker.protocol import Role


@dataclass(frozen=True)
class InstanceSpec:
    """One instance to start: its name (for the router, logs and Ray actors), the typed role the
    router uses it for, and the config its workers are built with."""

    instance_id: str
    role: Role
    config: WorkerConfig

    @property
    def prefills(self) -> bool:
        """Whether it prefills prompts whose KV another instance decodes."""
        return self.role in (Role.PREFILL, Role.ADAPTIVE)

    @property
    def decodes_remote(self) -> bool:
        """Whether it decodes KV another instance prefilled."""
        return self.role in (Role.DECODE, Role.ADAPTIVE)


@dataclass(frozen=True)
class KVPeers:
    """The instances one instance hands KV with, each with its TP size: `sources` prefill what
    it decodes, `targets` decode what it prefills (adaptive: both are every other instance)."""

    sources: dict[str, int] = field(default_factory=dict)
    targets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterSpec:
    """The instances to start and the router in front of them.

    Disaggregated: `num_prefill_instances` x `prefill` and `num_decode_instances` x `decode`.
    Colocated: `num_colocated_instances` x `colocated`, no prefill/decode.
    Adaptive: `num_adaptive_instances` x `adaptive`, each able to prefill for another, decode
    what another prefilled, or run a request start to end (the router chooses per request).
    `pin_cpus` gives each worker process (and its TP ranks) its own cores on CPU. `ray`: what
    only the Ray runtime reads (address, CPUs, custom resources, restarts).
    """

    router: RouterConfig
    prefill: WorkerConfig | None = None
    num_prefill_instances: int = 0
    decode: WorkerConfig | None = None
    num_decode_instances: int = 0
    colocated: WorkerConfig | None = None
    num_colocated_instances: int = 0
    adaptive: WorkerConfig | None = None
    num_adaptive_instances: int = 0
    pin_cpus: bool = False
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        if self.num_adaptive_instances > 0:
            if self.adaptive is None:
                raise ValueError("adaptive instances need a WorkerConfig in `adaptive`")
            if (
                self.num_prefill_instances
                or self.num_decode_instances
                or (self.num_colocated_instances)
            ):
                raise ValueError("an adaptive cluster has adaptive instances only")
            if self.num_adaptive_instances < 2:
                raise ValueError("an adaptive cluster needs >= 2 instances to move KV between")
            return
        if self.num_colocated_instances > 0:
            if self.colocated is None:
                raise ValueError("colocated instances need a WorkerConfig in `colocated`")
            if self.num_prefill_instances or self.num_decode_instances:
                raise ValueError("a cluster is either colocated or prefill + decode, not both")
            return
        if self.num_prefill_instances < 1 or self.num_decode_instances < 1:
            raise ValueError("a disaggregated cluster needs >= 1 prefill and >= 1 decode instance")
        if self.prefill is None or self.decode is None:
            raise ValueError(
                "a disaggregated cluster needs a `prefill` and a `decode` WorkerConfig"
            )

    @property
    def model_dir(self) -> str:
        return self.router.model_dir

    @property
    def is_colocated(self) -> bool:
        return self.num_colocated_instances > 0

    @property
    def is_adaptive(self) -> bool:
        return self.num_adaptive_instances > 0

    @property
    def num_workers(self) -> int:
        """Worker processes in all: one per TP rank of every instance."""
        return sum(self.worker_config(i).engine.tensor_parallel_size for i in self.instance_ids())

    def instances(self) -> list[InstanceSpec]:
        """prefill-0.., decode-0.. (or colocated-0.., adaptive-0..), each with its role and
        config: the one place an instance's name and role are decided."""
        counts = (
            (Role.PREFILL, self.prefill, self.num_prefill_instances),
            (Role.DECODE, self.decode, self.num_decode_instances),
            (Role.COLOCATED, self.colocated, self.num_colocated_instances),
            (Role.ADAPTIVE, self.adaptive, self.num_adaptive_instances),
        )
        return [
            InstanceSpec(f"{role.value}-{i}", role, config)
            for role, config, count in counts
            if config is not None
            for i in range(count)
        ]

    def instance(self, instance_id: str) -> InstanceSpec:
        """The instance named `instance_id`; KeyError names the ones there are."""
        for instance in self.instances():
            if instance.instance_id == instance_id:
                return instance
        raise KeyError(f"no instance {instance_id!r}; the cluster has {self.instance_ids()}")

    def worker_config(self, instance_id: str) -> WorkerConfig:
        """The config instance `instance_id` ("prefill-0", "decode-1", ...) is built with."""
        return self.instance(instance_id).config

    def instance_ids(self, role: Role | None = None) -> list[str]:
        """The names the router and logs use, of every instance or those of `role`."""
        return [i.instance_id for i in self.instances() if role is None or i.role == role]

    def kv_peers(self, instance_id: str) -> KVPeers:
        """The instances `instance_id` hands KV with (none for a colocated one)."""
        this = self.instance(instance_id)
        others = [i for i in self.instances() if i.instance_id != instance_id]
        tp = {i.instance_id: i.config.engine.tensor_parallel_size for i in others}
        return KVPeers(
            sources={
                i.instance_id: tp[i.instance_id]
                for i in others
                if this.decodes_remote and i.prefills
            },
            targets={
                i.instance_id: tp[i.instance_id]
                for i in others
                if this.prefills and i.decodes_remote
            },
        )

    def kv_pairs(self) -> list[tuple[str, str]]:
        """Every (prefilling instance, instance decoding its KV) pair: the KV channels."""
        return [
            (source, target)
            for source in self.instance_ids()
            for target in self.kv_peers(source).targets
        ]


def engine_config(config: ServeConfig, model_dir: str, tensor_parallel_size: int) -> EngineConfig:
    kv_cache = config.kv_cache
    return EngineConfig(
        model_dir=model_dir,
        dtype=config.dtype,
        device=config.device,
        tensor_parallel_size=tensor_parallel_size,
        block_size=kv_cache.block_size,
        num_kv_blocks=kv_cache.num_blocks,
        kv_cache_memory_bytes=kv_cache.memory_mb * 1024 * 1024,
        kv_cache_dtype=kv_cache.dtype,
        enable_prefix_caching=kv_cache.prefix_caching,
        max_model_len=config.router.max_model_len,
        speculative=speculative_config(config),
        cuda_graphs=config.gpu.cuda_graphs,
        attention_backend=config.gpu.attention_backend,
        fused_ops=None if config.gpu.fused_ops else False,  # None: where CUDA and triton are
        num_threads=config.cpu.threads,
        packed_linears=config.cpu.packed_linears,
        **dataclasses.asdict(config.scheduler),  # chunk_size, max_num_seqs, ...: the same names
    )


def speculative_config(config: ServeConfig) -> SpeculativeConfig | None:
    """The engine's speculation (null method: none); the section's keys are its names."""
    section = config.speculative
    if section.method is None:
        return None
    fields = dataclasses.asdict(section)
    if section.draft_model is not None:  # a folder, or a model name built on first use
        fields["draft_model"] = resolve_model(section.draft_model)
    return SpeculativeConfig(**fields)


def router_config(config: ServeConfig, model_dir: str) -> RouterConfig:
    """The router's config, built once here: both runtimes take it from the spec. The router
    section's keys are RouterConfig's names, but for the token (inline or from a file)."""
    router = dataclasses.asdict(config.router)
    del router["auth_token_file"]
    router["auth_token"] = config.router.resolved_auth_token()
    policies = {"colocated": config.colocated.policy, "adaptive": config.adaptive.policy}
    prefill_policy = policies.get(config.mode, config.prefill.policy)  # who picks the prefill
    return RouterConfig(
        model_dir=model_dir,
        metrics_host=config.router.host,
        block_size=config.kv_cache.block_size,
        prefill_policy=prefill_policy,
        decode_policy=config.decode.policy,
        **router,
    )


def build_cluster_spec(config: ServeConfig, model_dir: str | None = None) -> ClusterSpec:
    """The ClusterSpec of a config file; `model_dir` (if given) replaces the file's model."""
    model_dir = model_dir or resolve_model(config.model)
    router = router_config(config, model_dir)
    pin_cpus = config.pin_cpus and config.device == "cpu"  # CUDA workers drive a GPU, unpinned
    if config.mode == "colocated":
        engine = engine_config(config, model_dir, config.colocated.tensor_parallel_size)
        return ClusterSpec(
            router,
            colocated=WorkerConfig(engine),
            num_colocated_instances=config.colocated.instances,
            pin_cpus=pin_cpus,
            ray=config.ray,
        )
    kv_transfer = KVTransferConfig(**dataclasses.asdict(config.kv_transfer))  # the same names
    if config.mode == "adaptive":
        engine = engine_config(config, model_dir, config.adaptive.tensor_parallel_size)
        return ClusterSpec(
            router,
            adaptive=WorkerConfig.adaptive(engine, kv_transfer),
            num_adaptive_instances=config.adaptive.instances,
            pin_cpus=pin_cpus,
            ray=config.ray,
        )
    prefill = engine_config(config, model_dir, config.prefill.tensor_parallel_size)
    decode = engine_config(config, model_dir, config.decode.tensor_parallel_size)
    return ClusterSpec(
        router,
        prefill=WorkerConfig.prefill(prefill, kv_transfer),
        num_prefill_instances=config.prefill.instances,
        decode=WorkerConfig.decode(decode, kv_transfer),
        num_decode_instances=config.decode.instances,
        pin_cpus=pin_cpus,
        ray=config.ray,
    )
