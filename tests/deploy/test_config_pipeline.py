"""Every key of the serve config reaches the same place, with the same value, under Ray and
under --no-ray.

The keys are enumerated from the config's dataclasses, so a new key fails here until it has a
row in `table()`: the value to set (other than its default), and where it must land. Each key
is set alone; `open_cluster` builds the runtime the command line would (Ray, or plain processes
through the --no-ray flag), not started, and each runtime is asked what it will hand its workers
and its router: the same methods it starts them with. Both must agree in full, and the key's
value must be where its row says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from deploy.config.serve_config import ConfigError, ServeConfig, apply_overrides, parse_config
from deploy.runtime.launch import open_cluster
from deploy.runtime.local.local_cluster import LocalCluster
from deploy.runtime.ray import cluster as ray_cluster
from deploy.runtime.ray.cluster import RayCluster
from deploy.runtime.ray.placement import PlacementPlan
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig
from router.config import RouterConfig
from worker.config import WorkerConfig
from worker.protocol import Role


def serve_keys() -> list[str]:
    """Every key of the serve config: `model`, ..., `prefill.instances`, ..., `ray.max_restarts`."""
    sections = get_type_hints(ServeConfig)
    keys = []
    for top in dataclasses.fields(ServeConfig):
        section = sections[top.name]
        if dataclasses.is_dataclass(section):
            keys += [f"{top.name}.{key.name}" for key in dataclasses.fields(section)]
        else:
            keys.append(top.name)
    return keys


@dataclass
class View:
    """What a runtime, not started, will hand its processes (the rest: Ray only)."""

    runtime: str  # "ray" or "plain"
    workers: dict[str, WorkerConfig]
    router: RouterConfig
    pin_cpus: bool
    ray_start: tuple[str, Any] | None = None  # ("local", num_cpus) or ("join", address)
    placement: PlacementPlan | None = None
    actor_options: dict[str, Any] = field(default_factory=dict)


def engines(view: View) -> list[EngineConfig]:
    return [c.engine for c in view.workers.values()]


def one(values: Any) -> Any:
    """The value every worker got; all of them when they differ (then no row matches)."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else distinct


def plain_view(cluster: LocalCluster) -> View:
    return View("plain", cluster.worker_configs(), cluster.spec.router, cluster.spec.pin_cpus)


def ray_view(cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> View:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        ray_cluster, "start_local_ray", lambda _, cpus: calls.append(("local", cpus))
    )
    monkeypatch.setattr(
        ray_cluster, "connect_ray", lambda address, _: calls.append(("join", address))
    )
    cluster._start_ray()  # what `start` does first, with Ray itself left out
    workers, plan = cluster.worker_configs(), cluster.placement_plan(cluster_cpus=2.0)
    # the placement groups hold exactly the workers that get a config, at their TP sizes
    assert [(i.instance_id, i.role, i.tp_size) for i in plan.instances] == [
        (instance_id, config.role, config.engine.tensor_parallel_size)
        for instance_id, config in workers.items()
    ]
    assert plan.device == one(config.engine.device for config in workers.values())
    return View(
        "ray",
        dict(workers),
        cluster.spec.router,
        cluster.spec.pin_cpus,
        calls[0],
        plan,
        cluster.actor_options(),
    )


def engine(name: str) -> Callable[[View], Any]:
    return lambda view: one(getattr(e, name) for e in engines(view))


def router(name: str) -> Callable[[View], Any]:
    return lambda view: getattr(view.router, name)


def kv(name: str) -> Callable[[View], Any]:
    return lambda view: one(getattr(c.kv_transfer, name) for c in view.workers.values())


def ids(view: View) -> list[str]:
    return sorted(view.workers)


def resources(role: Role) -> Callable[[View], Any]:
    return lambda view: view.placement.resources(role) if view.placement else None


PROFILE = str(Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json")


@dataclass(frozen=True)
class Row:
    """Set `value` (with `also`, keys it needs); `where(view)` must then equal `expected`."""

    value: Any
    where: Callable[[View], Any]
    expected: Any = None  # None: `value` itself
    also: dict[str, Any] = field(default_factory=dict)


def table(tmp: Path) -> dict[str, Row]:
    (tmp / "other_model").mkdir()
    (tmp / "other_model" / "config.json").write_text("{}")
    for name, text in [("token", "s3cret\n"), ("cert.pem", "cert"), ("key.pem", "key")]:
        (tmp / name).write_text(text)
    other, cert, key = str(tmp / "other_model"), str(tmp / "cert.pem"), str(tmp / "key.pem")
    return {
        "model": Row(
            other,
            lambda v: (one(e.model_dir for e in engines(v)), v.router.model_dir),
            (other, other),
        ),
        "dtype": Row("bfloat16", engine("dtype")),
        "device": Row(
            "cuda", lambda v: (one(e.device for e in engines(v)), v.pin_cpus), ("cuda", False)
        ),  # pinning hands out CPU cores: not on CUDA
        "mode": Row("colocated", ids, ["colocated-0"]),
        "pin_cpus": Row(False, lambda v: v.pin_cpus),
        "prefill.instances": Row(2, ids, ["decode-0", "prefill-0", "prefill-1"]),
        "prefill.tensor_parallel_size": Row(
            2, lambda v: v.workers["prefill-0"].engine.tensor_parallel_size
        ),
        "prefill.policy": Row("round_robin", router("prefill_policy")),
        "decode.instances": Row(2, ids, ["decode-0", "decode-1", "prefill-0"]),
        "decode.tensor_parallel_size": Row(
            2, lambda v: v.workers["decode-0"].engine.tensor_parallel_size
        ),
        "decode.policy": Row("most_free_blocks", router("decode_policy")),
        "colocated.instances": Row(2, ids, ["colocated-0", "colocated-1"], {"mode": "colocated"}),
        "colocated.tensor_parallel_size": Row(
            2, engine("tensor_parallel_size"), also={"mode": "colocated"}
        ),
        "colocated.policy": Row(
            "round_robin", router("prefill_policy"), also={"mode": "colocated"}
        ),
        "adaptive.instances": Row(
            3,
            ids,
            ["adaptive-0", "adaptive-1", "adaptive-2"],
            {"mode": "adaptive", "router.latency_profile": PROFILE},
        ),
        "adaptive.tensor_parallel_size": Row(
            2,
            engine("tensor_parallel_size"),
            also={"mode": "adaptive", "router.latency_profile": PROFILE},
        ),
        "adaptive.policy": Row(
            "kv_aware",
            router("prefill_policy"),
            also={"mode": "adaptive", "router.latency_profile": PROFILE},
        ),
        "kv_cache.block_size": Row(
            8, lambda v: (one(e.block_size for e in engines(v)), v.router.block_size), (8, 8)
        ),
        "kv_cache.memory_mb": Row(3, engine("kv_cache_memory_bytes"), 3 * 1024 * 1024),
        "kv_cache.num_blocks": Row(100, engine("num_kv_blocks")),
        "kv_cache.prefix_caching": Row(False, engine("enable_prefix_caching")),
        "kv_cache.dtype": Row("int8", engine("kv_cache_dtype")),
        "kv_transfer.transfer_timeout_s": Row(5.0, kv("transfer_timeout_s")),
        "kv_transfer.start_timeout_s": Row(7.0, kv("start_timeout_s")),
        "kv_transfer.transport": Row("network", kv("transport")),
        "speculative.method": Row("ngram", engine("speculative"), SpeculativeConfig()),
        "speculative.num_tokens": Row(
            6,
            engine("speculative"),
            SpeculativeConfig(num_tokens=6),
            {"speculative.method": "ngram"},
        ),
        "speculative.draft_model": Row(
            other,
            engine("speculative"),
            SpeculativeConfig(method="draft", draft_model=other),
            {"speculative.method": "draft"},
        ),
        "speculative.prompt_lookup_min": Row(
            2,
            engine("speculative"),
            SpeculativeConfig(prompt_lookup_min=2),
            {"speculative.method": "ngram"},
        ),
        "speculative.prompt_lookup_max": Row(
            3,
            engine("speculative"),
            SpeculativeConfig(prompt_lookup_max=3),
            {"speculative.method": "ngram"},
        ),
        "gpu.cuda_graphs": Row(False, engine("cuda_graphs")),
        "gpu.attention_backend": Row("torch", engine("attention_backend")),
        "gpu.fused_ops": Row(False, engine("fused_ops")),
        "cpu.threads": Row(2, engine("num_threads")),
        "cpu.packed_linears": Row(False, engine("packed_linears")),
        "scheduler.chunk_size": Row(64, engine("chunk_size")),
        "scheduler.max_num_seqs": Row(7, engine("max_num_seqs")),
        "scheduler.max_num_batched_tokens": Row(4096, engine("max_num_batched_tokens")),
        "scheduler.slo_scheduling": Row(True, engine("slo_scheduling")),
        "router.host": Row(
            "0.0.0.0", lambda v: (v.router.host, v.router.metrics_host), ("0.0.0.0", "0.0.0.0")
        ),
        "router.port": Row(6000, router("port")),
        "router.metrics_port": Row(6001, router("metrics_port")),
        "router.http_host": Row("0.0.0.0", router("http_host")),
        "router.http_port": Row(6002, router("http_port")),
        "router.http_max_body_bytes": Row(1024, router("http_max_body_bytes")),
        "router.http_header_timeout_s": Row(2.5, router("http_header_timeout_s")),
        "router.http_body_timeout_s": Row(7.5, router("http_body_timeout_s")),
        "router.auth_token": Row("s3cret", router("auth_token")),
        "router.auth_exempt_health": Row(True, router("auth_exempt_health")),
        "router.auth_exempt_reflection": Row(True, router("auth_exempt_reflection")),
        "router.auth_token_file": Row(str(tmp / "token"), router("auth_token"), "s3cret"),
        "router.tls_cert_file": Row(
            cert, router("tls_cert_file"), also={"router.tls_key_file": key}
        ),
        "router.tls_key_file": Row(
            key, router("tls_key_file"), also={"router.tls_cert_file": cert}
        ),
        "router.max_running_requests": Row(3, router("max_running_requests")),
        "router.max_queued_requests": Row(2, router("max_queued_requests")),
        "router.max_model_len": Row(
            300,
            lambda v: (v.router.max_model_len, one(e.max_model_len for e in engines(v))),
            (300, 300),
        ),
        "router.worker_timeout_s": Row(7.5, router("worker_timeout_s")),
        "router.shutdown_grace_s": Row(12.0, router("shutdown_grace_s")),
        "router.max_retries": Row(5, router("max_retries")),
        "router.recovery_wait_s": Row(4.5, router("recovery_wait_s")),
        "router.latency_profile": Row(PROFILE, router("latency_profile")),
        "router.latency_profile_model": Row("m", router("latency_profile_model")),
        "router.default_ttft_slo_s": Row(1.5, router("default_ttft_slo_s")),
        "router.default_tpot_slo_s": Row(0.05, router("default_tpot_slo_s")),
        "router.adaptive_window_s": Row(4.0, router("adaptive_window_s")),
        "ray.enabled": Row(False, lambda v: v.runtime, "plain"),
        "ray.address": Row("auto", lambda v: v.ray_start, ("join", "auto")),
        "ray.num_cpus": Row(3, lambda v: v.ray_start, ("local", 3)),
        "ray.num_cpus_per_worker": Row(0.25, lambda v: v.placement.num_cpus_per_worker),
        "ray.prefill_resources": Row({"node_a": 0.01}, resources(Role.PREFILL)),
        "ray.decode_resources": Row({"node_b": 0.01}, resources(Role.DECODE)),
        "ray.colocated_resources": Row(
            {"node_a": 0.01}, resources(Role.COLOCATED), also={"mode": "colocated"}
        ),
        "ray.adaptive_resources": Row(
            {"node_b": 0.01},
            resources(Role.ADAPTIVE),
            also={"mode": "adaptive", "router.latency_profile": PROFILE},
        ),
        "ray.max_restarts": Row(5, lambda v: v.actor_options["max_restarts"]),
    }


# Keys with no meaning in one runtime, and why. Their row is checked in the other one only.
# Every mode runs on both runtimes, so no key is for plain processes only.
RAY_ONLY = {
    "ray.enabled": "picks the runtime: false is what --no-ray sets",
    "ray.address": "which Ray cluster to start or join",
    "ray.num_cpus": "the CPUs of the local Ray cluster",
    "ray.num_cpus_per_worker": "a Ray resource claim",
    "ray.prefill_resources": "Ray custom resources (node groups)",
    "ray.decode_resources": "Ray custom resources (node groups)",
    "ray.colocated_resources": "Ray custom resources (node groups)",
    "ray.adaptive_resources": "Ray custom resources (node groups)",
    "ray.max_restarts": "Ray's actor restarts (plain processes always restart)",
}
ONE_CHOICE = {"decode.policy": "the only decode policy: no other value to set"}


def settings_config(model_dir: str, settings: dict[str, Any]) -> ServeConfig:
    data: dict[str, Any] = {"model": model_dir}
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        (data.setdefault(section, {}) if section else data)[name] = value
    return parse_config(data)


def views(config: ServeConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[View, View]:
    """(the runtime `open_cluster` picks for `config`; the --no-ray one)."""
    plain = open_cluster(apply_overrides(config, {"ray.enabled": False}), config.model)
    assert isinstance(plain, LocalCluster)
    chosen = open_cluster(config, config.model)
    if isinstance(chosen, RayCluster):
        return ray_view(chosen, monkeypatch), plain_view(plain)
    assert isinstance(chosen, LocalCluster)
    return plain_view(chosen), plain_view(plain)


@pytest.fixture()
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # enough for the config's checks
    return str(tmp_path / "model")


def test_every_key_has_a_row_and_every_row_a_key(tmp_path: Path) -> None:
    assert sorted(table(tmp_path)) == sorted(serve_keys())
    assert set(RAY_ONLY) | set(ONE_CHOICE) <= set(serve_keys())


@pytest.mark.parametrize("key", serve_keys())
def test_key_reaches_the_same_place_under_ray_and_without(
    key: str, model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = table(tmp_path).get(key)
    assert row is not None, f"serve config key {key!r} has no row in table(): say where it lands"
    expected = row.value if row.expected is None else row.expected
    config = settings_config(model_dir, {**row.also, key: row.value})
    chosen, plain = views(config, monkeypatch)
    try:
        default = settings_config(model_dir, row.also)
    except ConfigError:  # TLS: a cert without its key is no config; compare with neither
        default = settings_config(model_dir, {})
    default_chosen, default_plain = views(default, monkeypatch)
    if key in RAY_ONLY:
        assert row.where(chosen) == expected != row.where(default_chosen)
        assert plain == default_plain  # plain processes ignore it
        return
    assert row.where(plain) == expected
    if key not in ONE_CHOICE:
        assert row.where(default_plain) != expected, "the row's value is the default"
    assert chosen.runtime == "ray", f"Ray refused {key}={row.value!r}"
    assert row.where(chosen) == expected
    assert (chosen.workers, chosen.router, chosen.pin_cpus) == (
        plain.workers,
        plain.router,
        plain.pin_cpus,
    )


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "adaptive"])
def test_every_mode_runs_on_ray_and_without(mode: str, model_dir: str) -> None:
    settings: dict[str, Any] = {"mode": mode}
    if mode == "adaptive":
        settings["router.latency_profile"] = PROFILE
    config = settings_config(model_dir, settings)
    assert isinstance(open_cluster(config, model_dir), RayCluster)
    plain = apply_overrides(config, {"ray.enabled": False})
    assert isinstance(open_cluster(plain, model_dir), LocalCluster)
