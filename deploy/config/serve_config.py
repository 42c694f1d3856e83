"""The serving config file (YAML): one frozen dataclass per section, checked on construction.

    config = load_config("deploy/local.yaml")             # or parse_config({...}) / ServeConfig()
    config = apply_overrides(config, port=50051, prefill_tp=2)
    spec = build_cluster_spec(config)                      # deploy/config/cluster_spec.py: role configs

Every section rejects keys it does not know, naming the key, where it was and the keys it takes,
so a typo fails at start-up instead of silently keeping a default. The schema, with defaults:

    model: demo                  # a Hugging Face model folder, "smollm2" or "demo" (built locally)
    dtype: float32               # float32 | float16 | bfloat16 | float64
    device: cpu                  # cpu | cuda
    mode: disaggregated          # disaggregated | colocated (the baseline)
    pin_cpus: true               # CPU mode: give each worker process its own set of cores
    prefill:   {instances: 1, tensor_parallel_size: 1, policy: least_tokens}
    decode:    {instances: 1, tensor_parallel_size: 1, policy: most_free_blocks}
    colocated: {instances: 1, tensor_parallel_size: 1, policy: least_tokens}
    kv_cache:  {block_size: 16, memory_mb: 256, num_blocks: null, prefix_caching: true}
    kv_transfer: {transfer_timeout_s: 30, start_timeout_s: 60}
    scheduler: {chunk_size: 512, max_num_seqs: 64, max_num_batched_tokens: 2048}
    router:    {host: 127.0.0.1, port: 50051, metrics_port: null, http_port: null,
                http_host: 127.0.0.1, auth_token: null,
                auth_token_file: null, tls_cert_file: null, tls_key_file: null,
                max_running_requests: 256, max_queued_requests: 256, max_model_len: null,
                worker_timeout_s: 10, shutdown_grace_s: 30}
    ray:       {enabled: true, address: null, num_cpus: null, num_cpus_per_worker: null,
                prefill_resources: {}, decode_resources: {}, max_restarts: -1}
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.config.checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_file,
    check_int,
    check_seconds,
    is_amount,
)
from deploy.config.models import MODEL_NAMES, check_tensor_parallel
from router.config import DECODE_POLICIES, PREFILL_POLICIES

DTYPES = ("float32", "float16", "bfloat16", "float64")
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class PrefillSection:
    """Prefill instances: how many, TP ranks each, and how the router picks one per request."""

    instances: int = 1
    tensor_parallel_size: int = 1
    policy: str = "least_tokens"

    def __post_init__(self) -> None:
        _check_instances("prefill", self.instances, self.tensor_parallel_size)
        check_choice("prefill", "policy", self.policy, PREFILL_POLICIES)


@dataclass(frozen=True)
class DecodeSection:
    """Decode instances (data parallel): how many, TP ranks each, and the router's policy."""

    instances: int = 1
    tensor_parallel_size: int = 1
    policy: str = "most_free_blocks"

    def __post_init__(self) -> None:
        _check_instances("decode", self.instances, self.tensor_parallel_size)
        check_choice("decode", "policy", self.policy, DECODE_POLICIES)


@dataclass(frozen=True)
class ColocatedSection:
    """Colocated replicas (mode: colocated), each prefilling and decoding its own requests."""

    instances: int = 1
    tensor_parallel_size: int = 1
    policy: str = "least_tokens"

    def __post_init__(self) -> None:
        _check_instances("colocated", self.instances, self.tensor_parallel_size)
        check_choice("colocated", "policy", self.policy, PREFILL_POLICIES)


def _check_instances(where: str, instances: Any, tensor_parallel_size: Any) -> None:
    check_int(where, "instances", instances, 0)
    check_int(where, "tensor_parallel_size", tensor_parallel_size, 1)


@dataclass(frozen=True)
class KVCacheConfig:
    """KV pool per instance: `num_blocks` if given, else as many blocks as `memory_mb` holds."""

    block_size: int = 16
    memory_mb: int = 256
    num_blocks: int | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_int("kv_cache", "block_size", self.block_size, 1)
        check_int("kv_cache", "memory_mb", self.memory_mb, 1)
        check_int("kv_cache", "num_blocks", self.num_blocks, 1, allow_none=True)
        check_bool("kv_cache", "prefix_caching", self.prefix_caching)


@dataclass(frozen=True)
class KVTransferSection:
    """Deadlines of one KV hand-off, in seconds (kv_transfer/config.py says what each bounds)."""

    transfer_timeout_s: float = 30.0
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_seconds("kv_transfer", "transfer_timeout_s", self.transfer_timeout_s)
        check_seconds("kv_transfer", "start_timeout_s", self.start_timeout_s, allow_zero=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: running sequences, the token budget, and the prefill chunk size."""

    chunk_size: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("chunk_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int("scheduler", name, getattr(self, name), 1)
        if self.chunk_size > self.max_num_batched_tokens:
            raise ConfigError(
                f"scheduler.chunk_size ({self.chunk_size}) must not exceed "
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}): "
                "lower the chunk size or raise the token budget"
            )


@dataclass(frozen=True)
class RouterSection:
    """Where the gRPC router listens, who may call it, and what it admits.

    Past `max_running_requests` dispatched plus `max_queued_requests` waiting, a request gets
    RESOURCE_EXHAUSTED. `max_model_len` (null: the model's) caps prompt plus output tokens, for
    the workers too. `worker_timeout_s` bounds one call to a worker. On SIGINT/SIGTERM, in-flight
    streams get `shutdown_grace_s` to finish (the drain) before they are cut.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    http_host: str = "127.0.0.1"  # the OpenAI-compatible HTTP API, when http_port is set
    http_port: int | None = None
    auth_token: str | None = None
    auth_token_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_running_requests: int = 256
    max_queued_requests: int = 256
    max_model_len: int | None = None
    worker_timeout_s: float = 10.0
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        check_int("router", "max_running_requests", self.max_running_requests, 1)
        check_int("router", "max_queued_requests", self.max_queued_requests, 0)
        check_int("router", "max_model_len", self.max_model_len, 2, allow_none=True)
        for name in ("worker_timeout_s", "shutdown_grace_s"):
            check_seconds("router", name, getattr(self, name))
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(
                f"router.host must be an address such as 127.0.0.1, got {self.host!r}"
            )
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535
            ):
                raise ConfigError(f"router.{name} must be a port in [0, 65535], got {value!r}")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError("router: give auth_token or auth_token_file, not both")
        if self.auth_token is not None and (
            not isinstance(self.auth_token, str) or not self.auth_token.strip()
        ):
            raise ConfigError("router.auth_token must be a non-empty string (or null for no auth)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("router: TLS needs both tls_cert_file and tls_key_file (or neither)")
        for name in ("auth_token_file", "tls_cert_file", "tls_key_file"):
            check_file("router", name, getattr(self, name))

    def resolved_auth_token(self) -> str | None:
        """The bearer token: given inline, or the first line of `auth_token_file`."""
        if self.auth_token_file is None:
            return self.auth_token
        token = Path(self.auth_token_file).expanduser().read_text().strip()
        if not token:
            raise ConfigError(f"router.auth_token_file {self.auth_token_file!r} is empty")
        return token


@dataclass(frozen=True)
class RaySection:
    """The Ray runtime's own settings; plain processes (`enabled: false`) have no use for them.

    `address: null` starts a local Ray cluster on 127.0.0.1 with `num_cpus` (null: this
    machine's); "auto" or "HOST:PORT" joins a running one. `num_cpus_per_worker: null` shares the
    cluster's CPUs among the workers (at most 1 each). `prefill_resources` / `decode_resources`
    are custom Ray resources added to each worker's bundle (e.g. {node_a: 0.01}) to pin a role
    to a node group. `max_restarts`: how often Ray restarts a worker actor that died; -1: always,
    as plain processes are (a limit would leave the instance down for good).
    """

    enabled: bool = True
    address: str | None = None
    num_cpus: int | None = None
    num_cpus_per_worker: float | None = None
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = -1

    def __post_init__(self) -> None:
        check_bool("ray", "enabled", self.enabled)
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError(
                f"ray.address must be 'auto', 'HOST:PORT' or null, got {self.address!r}"
            )
        check_int("ray", "num_cpus", self.num_cpus, 1, allow_none=True)
        cpus = self.num_cpus_per_worker
        if cpus is not None and not is_amount(cpus):
            raise ConfigError(f"ray.num_cpus_per_worker must be a number > 0, got {cpus!r}")
        check_int("ray", "max_restarts", self.max_restarts, -1)
        for name in ("prefill_resources", "decode_resources"):
            resources = getattr(self, name)
            if not isinstance(resources, dict):
                raise ConfigError(f"ray.{name} must map resource names to amounts: {resources!r}")
            for key, amount in resources.items():
                if not isinstance(key, str) or not is_amount(amount):
                    raise ConfigError(f"ray.{name}[{key!r}] must be a number > 0, got {amount!r}")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pdserve serve` needs; see the module docstring for the YAML form."""

    model: str = "demo"
    dtype: str = "float32"
    device: str = "cpu"
    mode: str = "disaggregated"
    pin_cpus: bool = True
    prefill: PrefillSection = field(default_factory=PrefillSection)
    decode: DecodeSection = field(default_factory=DecodeSection)
    colocated: ColocatedSection = field(default_factory=ColocatedSection)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    router: RouterSection = field(default_factory=RouterSection)
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a Hugging Face model folder, 'smollm2' or 'demo'")
        folder = Path(self.model).expanduser()
        if self.model not in MODEL_NAMES and not (folder / "config.json").is_file():
            raise ConfigError(
                f"model {self.model!r} is not a Hugging Face model folder (no config.json); "
                "give a folder with config.json, *.safetensors and a tokenizer, 'smollm2' "
                "(SmolLM2-135M-Instruct) or 'demo' (a small model built locally)"
            )
        check_choice("config", "dtype", self.dtype, DTYPES)
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"config.device must be 'cpu' or 'cuda', got {self.device!r}")
        check_choice("config", "mode", self.mode, MODES)
        check_bool("config", "pin_cpus", self.pin_cpus)
        for name, section_type in _SECTIONS.items():
            if not isinstance(getattr(self, name), section_type):
                raise ConfigError(f"{name} must be a {section_type.__name__}")
        if self.mode == "disaggregated" and (
            self.prefill.instances < 1 or self.decode.instances < 1
        ):
            raise ConfigError(
                "mode disaggregated needs prefill.instances >= 1 and decode.instances >= 1 "
                "(or set mode: colocated)"
            )
        if self.mode == "colocated" and self.colocated.instances < 1:
            raise ConfigError("mode colocated needs colocated.instances >= 1")
        if self.model not in MODEL_NAMES:
            self.check_tensor_parallel(str(folder))

    def check_tensor_parallel(self, model_dir: str) -> None:
        """ConfigError naming the heads and the allowed sizes when a TP size does not fit the
        model (a named model is checked once its folder exists: the CLI calls this then)."""
        roles = ("colocated",) if self.mode == "colocated" else ("prefill", "decode")
        sizes = {role: getattr(self, role).tensor_parallel_size for role in roles}
        try:
            check_tensor_parallel(model_dir, sizes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def parse_config(data: dict[str, Any] | None) -> ServeConfig:
    """A ServeConfig from the YAML's mapping; ConfigError names any unknown key or bad value."""
    return _build(ServeConfig, data or {}, "config")


def load_config(path: str | Path) -> ServeConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys (model:, prefill:, ...)")
    return parse_config(data)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(fields)}"
            )
        section = _SECTIONS.get(key) if cls is ServeConfig else None
        kwargs[key] = _build(section, value, key) if section is not None else value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # e.g. a wrong type that a comparison trips over
        raise ConfigError(f"{where}: {exc}") from None


_SECTIONS: dict[str, type] = {
    "prefill": PrefillSection,
    "decode": DecodeSection,
    "colocated": ColocatedSection,
    "kv_cache": KVCacheConfig,
    "kv_transfer": KVTransferSection,
    "scheduler": SchedulerConfig,
    "router": RouterSection,
    "ray": RaySection,
}


def apply_overrides(config: ServeConfig, **overrides: Any) -> ServeConfig:
    """The command line's flags over the file; a None value leaves the file's setting.

    Keys: model, host, port, metrics_port, http_port, prefill_instances, prefill_tp, decode_instances, decode_tp,
    colocated_instances, colocated_tp, no_ray (True turns Ray off), mode.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    sections: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}, "colocated": {}}
    router: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in given.items():
        if key in ("host", "port", "metrics_port", "http_port"):
            router[key] = value
        elif key.endswith("_instances") and key.split("_")[0] in sections:
            sections[key.split("_")[0]]["instances"] = value
        elif key.endswith("_tp") and key.split("_")[0] in sections:
            sections[key.split("_")[0]]["tensor_parallel_size"] = value
        elif key == "no_ray":
            top["ray"] = dataclasses.replace(config.ray, enabled=not value)
        elif key in ("model", "mode"):
            top[key] = value
        else:
            raise ConfigError(f"unknown override {key!r}")
    for name, changes in sections.items():
        if changes:
            top[name] = dataclasses.replace(getattr(config, name), **changes)
    if router:
        top["router"] = dataclasses.replace(config.router, **router)
    return dataclasses.replace(config, **top)
