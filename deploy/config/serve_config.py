"""The serving config file (YAML): one frozen dataclass per section, checked on construction.

    config = load_config("deploy/local.yaml")             # or parse_config({...}) / ServeConfig()
    config = apply_overrides(config, {"router.port": 50051, "prefill.tensor_parallel_size": 2})
    spec = build_cluster_spec(config)                      # deploy/config/cluster_spec.py: role configs

The dataclasses below are the schema: each field is a key of the file, declared once with its
default and its check (deploy/config/checks.py); deploy/local.yaml is an example file. Every
section rejects keys it does not know, naming the key, where it was and the keys it takes, so a
typo fails at start-up instead of silently keeping a default.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.config import checks
from deploy.config.checks import Check, ConfigError, knob
from deploy.config.models import MODEL_NAMES, check_tensor_parallel
from engine.kv_quant import KV_CACHE_DTYPES
from router.config import DECODE_POLICIES, PREFILL_POLICIES

DTYPES = ("float32", "float16", "bfloat16", "float64")
MODES = ("disaggregated", "colocated", "adaptive")


@dataclass(frozen=True)
class RoleSection:
    """Instances of one role (prefill, colocated): how many, TP ranks each, and how the router
    picks one per request."""

    instances: int = knob(1, checks.integer(0))
    tensor_parallel_size: int = knob(1, checks.integer(1))
    policy: str = knob("least_tokens", checks.choice(PREFILL_POLICIES))


@dataclass(frozen=True)
class DecodeSection(RoleSection):
    """Decode instances (data parallel), picked by the decode policy."""

    policy: str = knob("least_batch", checks.choice(DECODE_POLICIES))


@dataclass(frozen=True)
class AdaptiveSection:
    """Instances that each prefill, decode, or both, as the router places each request (mode
    adaptive); at least two, so that KV can move between them."""

    instances: int = knob(2, checks.integer(2))
    tensor_parallel_size: int = knob(1, checks.integer(1))
    # kv_aware: placement counts the prompt tokens each instance's prefix cache holds
    policy: str = knob("least_tokens", checks.choice(PREFILL_POLICIES))


@dataclass(frozen=True)
class KVCacheConfig:
    """KV pool per instance: `num_blocks` if given, else as many blocks as `memory_mb` holds."""

    block_size: int = knob(16, checks.integer(1))
    memory_mb: int = knob(256, checks.integer(1))
    num_blocks: int | None = knob(None, checks.integer(1, optional=True))
    prefix_caching: bool = knob(True, checks.boolean)
    # how the pool stores KV: auto (the model's dtype), fp8_e4m3 or int8 (8 bits and a scale
    # per block and KV head: about 1/4 of float32's bytes, 1/2 of bfloat16's); prefill and
    # decode instances must agree
    dtype: str = knob("auto", checks.choice(KV_CACHE_DTYPES))


@dataclass(frozen=True)
class KVTransferSection:
    """Deadlines of one KV hand-off, in seconds, and its transport (kv_transfer/config.py says
    what each means)."""

    transfer_timeout_s: float = knob(30.0, checks.seconds())
    start_timeout_s: float = knob(60.0, checks.seconds(allow_zero=True))
    # how KV moves between a prefill and a decode rank: auto (through shared memory / CUDA IPC
    # when they run on one node, else the network), same_node, or network (gloo / NCCL)
    transport: str = knob("auto", checks.choice(("auto", "same_node", "network")))


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: running sequences, the token budget, and the prefill chunk size.
    `slo_scheduling`: hold a prompt chunk back while it would make a running decode miss its
    TPOT SLO, until the prompt's own TTFT SLO cannot wait (engine/slo.py); only requests that
    carry SLOs take part. Always on in mode adaptive, whose router predicts with it."""

    chunk_size: int = knob(512, checks.integer(1))
    max_num_seqs: int = knob(64, checks.integer(1))
    max_num_batched_tokens: int = knob(2048, checks.integer(1))
    slo_scheduling: bool = knob(False, checks.boolean)


@dataclass(frozen=True)
class GPUSection:
    """The GPU engine's switches (docs/guides/gpu.md); no effect on CPU. `cuda_graphs`: replay
    pure-decode steps from CUDA graphs; `attention_backend`: auto, torch, triton or flash;
    `fused_ops`: the fused Triton norm, SiLU x mul and rotary where the model family has them."""

    cuda_graphs: bool = knob(True, checks.boolean)
    attention_backend: str = knob("auto", checks.choice(("auto", "torch", "triton", "flash")))
    fused_ops: bool = knob(True, checks.boolean)


@dataclass(frozen=True)
class CPUSection:
    """The CPU engine's switches; no effect on CUDA. `threads`: torch threads per TP rank, each
    pinned to a core of its own with pin_cpus (on Ray, give each worker as many with
    ray.num_cpus_per_worker); `packed_linears`: linear layers on oneDNN over weights packed once
    at load (engine/cpu_linear.py), false for F.linear."""

    threads: int = knob(1, checks.integer(1))
    packed_linears: bool = knob(True, checks.boolean)


def _check_speculative_method(key: str, value: Any) -> None:
    if value is None or value in ("ngram", "draft"):
        return
    raise ConfigError(f"{key} must be ngram, draft or null (off), got {value!r}")


@dataclass(frozen=True)
class SpeculativeSection:
    """Speculative decoding on every instance that decodes (engine/speculative/): `method`
    null is off; "ngram" proposes up to `num_tokens` tokens a step by prompt lookup, matching
    the last `prompt_lookup_min`..`prompt_lookup_max` tokens; "draft" proposes them with
    `draft_model` (a model folder, or a name `model` accepts, with the target's tokenizer). A
    request may turn it off."""

    method: str | None = knob(None, _check_speculative_method)
    num_tokens: int = knob(4, checks.integer(1))
    prompt_lookup_min: int = knob(1, checks.integer(1))
    prompt_lookup_max: int = knob(4, checks.integer(1))
    draft_model: str | None = knob(
        None,
        checks.rule(
            lambda value: isinstance(value, str) and value,
            "{key} must be a model folder or name, got {value!r}",
            optional=True,
        ),
    )

    def __post_init__(self) -> None:
        for knob_field in dataclasses.fields(self):  # each value's type before it is compared
            knob_field.metadata["check"](
                f"speculative.{knob_field.name}", getattr(self, knob_field.name)
            )
        if self.num_tokens > 32:
            raise ConfigError(f"speculative.num_tokens must be at most 32, got {self.num_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise ConfigError(
                "speculative.draft_model is needed with method draft, and only with it"
            )


@dataclass(frozen=True)
class RouterSection:
    """Where the gRPC router listens, who may call it, and what it admits.

    Past `max_running_requests` dispatched plus `max_queued_requests` waiting, a request gets
    RESOURCE_EXHAUSTED. `max_model_len` (null: the model's) caps prompt plus output tokens, for
    the workers too. `worker_timeout_s` bounds one call to a worker. On SIGINT/SIGTERM, in-flight
    streams get `shutdown_grace_s` to finish (the drain) before they are cut. A request whose
    instance is lost is placed again (retried before its first token, migrated after it) at
    most `max_retries` times; one that finds no healthy instance waits up to `recovery_wait_s`
    for one to come back (router/recovery.py).
    """

    host: str = knob("127.0.0.1", checks.address)
    port: int = knob(50051, checks.port_number)
    metrics_port: int | None = knob(None, checks.port_number)
    http_host: str = knob("127.0.0.1", checks.address)  # the HTTP API's, when http_port is set
    http_port: int | None = knob(None, checks.port_number)
    # the HTTP API's bounds on a client (RouterConfig says why): the body's size (413 past it),
    # the time to send the request head, and the longest pause within a body
    http_max_body_bytes: int = knob(4 * 1024 * 1024, checks.integer(1))
    http_header_timeout_s: float = knob(10.0, checks.seconds())
    http_body_timeout_s: float = knob(30.0, checks.seconds())
    auth_token: str | None = knob(None, checks.token)
    auth_token_file: str | None = knob(None, checks.file)
    auth_exempt_health: bool = knob(False, checks.boolean)  # health open to tokenless probes
    auth_exempt_reflection: bool = knob(False, checks.boolean)  # reflection open (grpcurl)
    tls_cert_file: str | None = knob(None, checks.file)
    tls_key_file: str | None = knob(None, checks.file)
    max_running_requests: int = knob(256, checks.integer(1))
    max_queued_requests: int = knob(256, checks.integer(0))
    max_model_len: int | None = knob(None, checks.integer(2, optional=True))
    worker_timeout_s: float = knob(10.0, checks.seconds())
    shutdown_grace_s: float = knob(30.0, checks.seconds())
    max_retries: int = knob(3, checks.integer(0))
    recovery_wait_s: float = knob(30.0, checks.seconds(allow_zero=True))
    # mode adaptive: the latency profile (`pdserve profile`) placement predicts with, and the
    # SLOs of a request that sets none (router/adaptive/placer.py)
    latency_profile: str | None = knob(None, checks.file)
    latency_profile_model: str | None = knob(None, checks.optional_text)
    default_ttft_slo_s: float = knob(2.0, checks.seconds())
    default_tpot_slo_s: float = knob(0.1, checks.seconds())
    adaptive_window_s: float = knob(10.0, checks.seconds())  # the arrivals roles follow

    def __post_init__(self) -> None:
        # Pairs first, before the files are looked at: a lone TLS file is "needs both".
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError("router: give auth_token or auth_token_file, not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("router: TLS needs both tls_cert_file and tls_key_file (or neither)")

    def resolved_auth_token(self) -> str | None:
        """The bearer token: given inline, or the content of `auth_token_file`."""
        if self.auth_token_file is None:
            return self.auth_token
        return checks.read_token_file(self.auth_token_file, "router.auth_token_file")


@dataclass(frozen=True)
class RaySection:
    """The Ray runtime's own settings; plain processes (`enabled: false`) have no use for them.

    `address: null` starts a local Ray cluster on 127.0.0.1 with `num_cpus` (null: this
    machine's); "auto" or "HOST:PORT" joins a running one. `num_cpus_per_worker: null` shares the
    cluster's CPUs among the workers (at most 1 each). `prefill_resources`, `decode_resources`,
    `colocated_resources` and `adaptive_resources` are custom Ray resources added to the bundles
    of that role's workers (e.g. {node_a: 0.01}) to pin the role to a node group. `max_restarts`: how often Ray restarts a worker actor that died; -1: always,
    as plain processes are (a limit would leave the instance down for good).
    """

    enabled: bool = knob(True, checks.boolean)
    address: str | None = knob(None, checks.ray_address)
    num_cpus: int | None = knob(None, checks.integer(1, optional=True))
    num_cpus_per_worker: float | None = knob(None, checks.amount)
    prefill_resources: dict[str, float] = knob({}, checks.resources)
    decode_resources: dict[str, float] = knob({}, checks.resources)
    colocated_resources: dict[str, float] = knob({}, checks.resources)
    adaptive_resources: dict[str, float] = knob({}, checks.resources)
    max_restarts: int = knob(-1, checks.integer(-1))


def _check_model(_key: str, model: Any) -> None:
    if not isinstance(model, str) or not model:
        raise ConfigError("model must be a Hugging Face model folder, 'smollm2' or 'demo'")
    if model not in MODEL_NAMES and not (Path(model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"model {model!r} is not a Hugging Face model folder (no config.json); "
            "give a folder with config.json, *.safetensors and a tokenizer, 'smollm2' "
            "(SmolLM2-135M-Instruct) or 'demo' (a small model built locally)"
        )


def section(cls: type) -> Any:
    """A ServeConfig field holding a section: the loader builds it from a mapping of its keys."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pdserve serve` needs: the file's top-level keys and its sections."""

    model: str = knob("demo", _check_model)  # a Hugging Face model folder, "smollm2" or "demo"
    dtype: str = knob("float32", checks.choice(DTYPES))
    device: str = knob("cpu", checks.cpu_or_cuda)
    mode: str = knob("disaggregated", checks.choice(MODES))  # or colocated: the baseline
    pin_cpus: bool = knob(True, checks.boolean)  # CPU: each worker process has its own cores
    prefill: RoleSection = section(RoleSection)
    decode: DecodeSection = section(DecodeSection)
    colocated: RoleSection = section(RoleSection)
    adaptive: AdaptiveSection = section(AdaptiveSection)
    kv_cache: KVCacheConfig = section(KVCacheConfig)
    kv_transfer: KVTransferSection = section(KVTransferSection)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    speculative: SpeculativeSection = section(SpeculativeSection)
    gpu: GPUSection = section(GPUSection)
    cpu: CPUSection = section(CPUSection)
    router: RouterSection = section(RouterSection)
    ray: RaySection = section(RaySection)

    def __post_init__(self) -> None:
        for key, value, check in self._knobs():
            check(key, value)
        scheduler = self.scheduler
        if scheduler.chunk_size > scheduler.max_num_batched_tokens:
            raise ConfigError(
                f"scheduler.chunk_size ({scheduler.chunk_size}) must not exceed "
                f"scheduler.max_num_batched_tokens ({scheduler.max_num_batched_tokens}): "
                "lower the chunk size or raise the token budget"
            )
        if self.mode == "disaggregated" and (
            self.prefill.instances < 1 or self.decode.instances < 1
        ):
            raise ConfigError(
                "mode disaggregated needs prefill.instances >= 1 and decode.instances >= 1 "
                "(or set mode: colocated)"
            )
        if self.mode == "colocated" and self.colocated.instances < 1:
            raise ConfigError("mode colocated needs colocated.instances >= 1")
        if self.mode == "adaptive" and self.router.latency_profile is None:
            raise ConfigError(
                "mode adaptive needs router.latency_profile: a latency profile of this model "
                "and device, which `pdserve profile` writes"
            )
        if self.model not in MODEL_NAMES:
            self.check_tensor_parallel(str(Path(self.model).expanduser()))

    def _knobs(self) -> Iterator[tuple[str, Any, Check]]:
        """(dotted key, value, check) of every knob, a section's after its own type is checked."""
        for top in dataclasses.fields(self):
            value, section_type = getattr(self, top.name), top.metadata.get("section")
            if section_type is None:
                yield f"config.{top.name}", value, top.metadata["check"]
                continue
            if not isinstance(value, section_type):
                raise ConfigError(f"{top.name} must be a {section_type.__name__}")
            for knob_field in dataclasses.fields(value):
                key = f"{top.name}.{knob_field.name}"
                yield key, getattr(value, knob_field.name), knob_field.metadata["check"]

    def check_tensor_parallel(self, model_dir: str) -> None:
        """ConfigError naming the heads and the allowed sizes when a TP size does not fit the
        model (a named model is checked once its folder exists: the CLI calls this then)."""
        roles = {"colocated": ("colocated",), "adaptive": ("adaptive",)}.get(
            self.mode, ("prefill", "decode")
        )
        check_tensor_parallel(
            model_dir, {role: getattr(self, role).tensor_parallel_size for role in roles}
        )


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
        section_type = fields[key].metadata.get("section")
        kwargs[key] = value if section_type is None else _build(section_type, value, key)
    return cls(**kwargs)  # every key is known and each value is checked before it is compared


def apply_overrides(config: ServeConfig, overrides: Mapping[str, Any]) -> ServeConfig:
    """`config` with keys set by their dotted names ("model", "router.port"), checked as the
    file is: an unknown key or a bad value is a ConfigError naming it."""
    data = dataclasses.asdict(config)
    for key, value in overrides.items():
        where, _, name = key.rpartition(".")
        target = data.setdefault(where, {}) if where else data
        if not isinstance(target, dict):
            raise ConfigError(f"unknown key {key!r}: {where} is not a section")
        target[name] = value
    return parse_config(data)
