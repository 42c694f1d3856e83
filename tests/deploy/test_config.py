"""The serving config file: schema, unknown keys, bad values, flag overrides, and the mapping onto
the ClusterSpec both runtimes take (every key, runtime by runtime: test_config_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.cli.main import build_parser, serve_config
from deploy.config.cluster_spec import KVPeers, build_cluster_spec
from deploy.config.serve_config import (
    ConfigError,
    ServeConfig,
    apply_overrides,
    load_config,
    parse_config,
)
from deploy.runtime.launch import open_cluster
from deploy.runtime.local.local_cluster import LocalCluster
from deploy.runtime.ray.cluster import RayCluster
from worker.protocol import Role

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")  # enough for the config's folder check
    return str(tmp_path)


def test_local_yaml_is_one_prefill_at_tp2_and_two_decodes_on_loopback() -> None:
    config = load_config(REPO_ROOT / "deploy" / "local.yaml")
    assert config.model == "demo" and config.mode == "disaggregated"
    assert (config.prefill.instances, config.prefill.tensor_parallel_size) == (1, 2)
    assert (config.decode.instances, config.decode.tensor_parallel_size) == (2, 1)
    assert config.router.host == "127.0.0.1" and config.ray.address is None


def test_defaults_equal_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == ServeConfig() == parse_config({})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"prefil": {}},
            "unknown key 'prefil' in config (did you mean 'prefill'?); valid keys: "
            "model, dtype, device, mode, pin_cpus, prefill, decode",
        ),
        (
            {"prefill": {"tp": 2}},
            "unknown key 'tp' in prefill; valid keys: instances, tensor_parallel_size, policy",
        ),
        ({"router": {"prot": 1}}, "unknown key 'prot' in router (did you mean 'port'?)"),
        (
            {"kv_cache": {"memory": 8}},
            "unknown key 'memory' in kv_cache (did you mean 'memory_mb'?)",
        ),
    ],
)
def test_unknown_keys_are_named_with_the_valid_ones(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prefill": {"instances": -1}}, "prefill.instances must be an integer >= 0, got -1"),
        (
            {"decode": {"tensor_parallel_size": 0}},
            "decode.tensor_parallel_size must be an integer >= 1, got 0",
        ),
        (
            {"prefill": {"tensor_parallel_size": "2"}},
            "prefill.tensor_parallel_size must be an integer >= 1, got '2'",
        ),
        (
            {"prefill": {"policy": "random"}},
            "prefill.policy must be one of least_tokens, round_robin, kv_aware; got 'random'",
        ),
        (
            {"decode": {"policy": "least_tokens"}},
            "decode.policy must be one of least_batch, most_free_blocks; got 'least_tokens'",
        ),
        ({"dtype": "fp8"}, "config.dtype must be one of float32, float16, bfloat16, float64"),
        ({"device": "tpu"}, "config.device must be 'cpu' or 'cuda', got 'tpu'"),
        ({"router": {"port": 70000}}, "router.port must be a port in [0, 65535], got 70000"),
        ({"router": {"tls_cert_file": "/nonexistent.pem"}}, "router: TLS needs both"),
        (
            {"router": {"auth_token_file": "/nonexistent"}},
            "router.auth_token_file: '/nonexistent' is not a file",
        ),
        (
            {"router": {"auth_token": "a", "auth_token_file": "b"}},
            "router: give auth_token or auth_token_file, not both",
        ),
        (
            {"scheduler": {"chunk_size": 4096}},
            "scheduler.chunk_size (4096) must not exceed scheduler.max_num_batched_tokens (2048)",
        ),
        ({"kv_cache": {"num_blocks": 0}}, "kv_cache.num_blocks must be an integer >= 1, got 0"),
        ({"decode": {"instances": 0}}, "mode disaggregated needs prefill.instances >= 1"),
        ({"model": "/no/such/folder"}, "model '/no/such/folder' is not a Hugging Face model"),
        ({"ray": {"enabled": "yes"}}, "ray.enabled must be true or false, got 'yes'"),
        ({"prefill": 2}, "prefill must be a mapping of keys, got 2"),
        ({"kv_cache": {"prefix_caching": "no"}}, "kv_cache.prefix_caching must be true or false"),
        (
            {"kv_transfer": {"transfer_timeout_s": 0}},
            "kv_transfer.transfer_timeout_s must be a number of seconds > 0, got 0",
        ),
        (
            {"kv_transfer": {"start_timeout_s": -1}},
            "kv_transfer.start_timeout_s must be a number of seconds >= 0, got -1",
        ),
        ({"ray": {"max_restarts": -2}}, "ray.max_restarts must be an integer >= -1, got -2"),
        ({"cpu": {"threads": 0}}, "cpu.threads must be an integer >= 1, got 0"),
        ({"ray": {"num_cpus_per_worker": 0}}, "ray.num_cpus_per_worker must be a number > 0"),
        (
            {"ray": {"prefill_resources": {"node_a": 0}}},
            "ray.prefill_resources['node_a'] must be a number > 0, got 0",
        ),
        ({"ray": {"decode_resources": ["node_b"]}}, "ray.decode_resources must map resource"),
    ],
)
def test_bad_values_say_what_to_fix(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert str(error.value).startswith(message)


def test_a_file_that_is_not_a_mapping_or_not_yaml_is_refused(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- model\n- demo\n")
    (tmp_path / "bad.yaml").write_text("model: [demo\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_command_line_flags_override_the_file(tmp_path: Path, model_dir: str) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "prefill: {instances: 2, tensor_parallel_size: 1, policy: round_robin}\n"
        "decode: {instances: 3}\nrouter: {port: 6000, metrics_port: 6001}\n"
    )
    argv = [
        "serve",
        "--config",
        str(path),
        "--model",
        model_dir,
        "--host",
        "0.0.0.0",
        "--port",
        "7000",
        "--prefill-tp",
        "2",
        "--decode-instances",
        "1",
        "--no-ray",
    ]
    config = serve_config(build_parser().parse_args(argv))
    assert config.model == model_dir
    assert (config.router.host, config.router.port, config.router.metrics_port) == (
        "0.0.0.0",
        7000,
        6001,
    )
    assert config.prefill == config.prefill.__class__(2, 2, "round_robin")  # file kept instances
    assert (config.decode.instances, config.ray.enabled) == (1, False)


def test_flags_alone_serve_without_a_file(model_dir: str) -> None:
    argv = ["serve", "--model", model_dir, "--prefill-instances", "1", "--decode-tp", "2"]
    config = serve_config(build_parser().parse_args(argv))
    assert config == apply_overrides(
        ServeConfig(), {"model": model_dir, "decode.tensor_parallel_size": 2}
    )
    assert config.ray.enabled and config.decode.tensor_parallel_size == 2


def test_overrides_are_checked_like_the_file(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="prefill.tensor_parallel_size must be an integer >= 1"):
        apply_overrides(ServeConfig(), {"prefill.tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match="router.port must be a port"):
        apply_overrides(ServeConfig(), {"router.port": -5})


def test_cluster_spec_carries_every_setting_to_the_role_configs(
    tmp_path: Path, model_dir: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = parse_config(
        {
            "model": model_dir,
            "dtype": "bfloat16",
            "prefill": {"instances": 1, "tensor_parallel_size": 2, "policy": "kv_aware"},
            "decode": {"instances": 3},
            "kv_cache": {"block_size": 8, "memory_mb": 3},
            "scheduler": {"chunk_size": 64, "max_num_seqs": 7, "max_num_batched_tokens": 128},
            "cpu": {"threads": 2, "packed_linears": False},
            "router": {"port": 0, "metrics_port": 0, "auth_token_file": str(token_file)},
        }
    )
    spec = build_cluster_spec(config)
    assert spec.instance_ids() == ["prefill-0", "decode-0", "decode-1", "decode-2"]
    assert [i.role for i in spec.instances()] == [Role.PREFILL] + [Role.DECODE] * 3
    assert spec.instance_ids(Role.DECODE) == ["decode-0", "decode-1", "decode-2"]
    assert spec.worker_config("decode-2") is spec.decode and spec.instance("prefill-0").prefills
    with pytest.raises(KeyError, match="no instance 'decode-3'"):
        spec.instance("decode-3")
    assert spec.prefill is not None and spec.decode is not None
    prefill, decode = spec.prefill.engine, spec.decode.engine
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (2, 1)
    assert prefill.dtype == decode.dtype == "bfloat16"
    assert prefill.block_size == spec.router.block_size == 8
    assert prefill.kv_cache_memory_bytes == 3 * 1024 * 1024 and prefill.num_kv_blocks is None
    assert (decode.chunk_size, decode.max_num_seqs, decode.max_num_batched_tokens) == (64, 7, 128)
    assert (prefill.num_threads, prefill.packed_linears) == (2, False)
    assert spec.router.auth_token == "s3cret" and spec.router.prefill_policy == "kv_aware"
    ray_cluster = open_cluster(config, model_dir)
    assert isinstance(ray_cluster, RayCluster)  # not started: what it would start
    workers = ray_cluster.worker_configs()
    assert workers == {
        "prefill-0": spec.prefill,
        **dict.fromkeys(spec.instance_ids()[1:], spec.decode),
    }
    assert ray_cluster.spec.router.auth_token == "s3cret"
    assert ray_cluster.spec.router.prefill_policy == "kv_aware"


def test_both_runtimes_get_the_same_router_config(model_dir: str) -> None:
    """One builder: the limits a user sets reach the router whether Ray runs it or not."""
    router = {
        "port": 0,
        "max_running_requests": 3,
        "max_queued_requests": 2,
        "max_model_len": 300,
        "worker_timeout_s": 7.5,
        "shutdown_grace_s": 12,
        "http_port": 0,
    }
    config = parse_config({"model": model_dir, "router": router})
    plain = LocalCluster(build_cluster_spec(config)).spec.router
    assert plain == RayCluster(build_cluster_spec(config)).spec.router
    assert (plain.max_running_requests, plain.max_queued_requests) == (3, 2)
    assert (plain.max_model_len, plain.worker_timeout_s, plain.shutdown_grace_s) == (300, 7.5, 12)
    assert (plain.http_host, plain.http_port) == ("127.0.0.1", 0)  # the HTTP API, on loopback
    spec = build_cluster_spec(config)
    assert spec.prefill is not None and spec.prefill.engine.max_model_len == 300
    # the defaults agree too, and the drain outlasts a typical stream
    default = parse_config({"model": model_dir})
    plain = LocalCluster(build_cluster_spec(default)).spec.router
    assert plain == RayCluster(build_cluster_spec(default)).spec.router
    assert (plain.max_running_requests, plain.max_queued_requests) == (256, 256)
    assert plain.shutdown_grace_s == 30
    assert plain.http_port is None  # the HTTP API is opt-in


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_running_requests", 0),
        ("max_queued_requests", -1),
        ("shutdown_grace_s", 0),
        ("worker_timeout_s", "soon"),
        ("max_model_len", 1),
        ("default_tpot_slo_s", float("inf")),
        ("default_ttft_slo_s", -1.0),
    ],
)
def test_router_limits_are_checked(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"router.{key} must be"):
        parse_config({"router": {key: value}})


def test_colocated_layout_has_replicas_and_no_kv_peers(model_dir: str) -> None:
    config = parse_config(
        {
            "model": model_dir,
            "mode": "colocated",
            "colocated": {"instances": 3, "policy": "round_robin"},
        }
    )
    spec = build_cluster_spec(config)
    assert spec.is_colocated and spec.instance_ids() == [
        "colocated-0",
        "colocated-1",
        "colocated-2",
    ]
    assert spec.router.prefill_policy == "round_robin"
    assert spec.kv_pairs() == [] and spec.kv_peers("colocated-1") == KVPeers()
    assert isinstance(open_cluster(config, model_dir), RayCluster)


def test_adaptive_layout_needs_a_latency_profile_and_pairs_every_instance(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="mode adaptive needs router.latency_profile"):
        parse_config({"model": model_dir, "mode": "adaptive"})
    with pytest.raises(ConfigError, match="adaptive.instances must be"):
        parse_config({"mode": "adaptive", "adaptive": {"instances": 1}})
    profile = str(REPO_ROOT / "tests" / "data" / "profile-2core.json")
    config = parse_config(
        {
            "model": model_dir,
            "mode": "adaptive",
            "adaptive": {"instances": 3},
            "router": {"latency_profile": profile, "default_tpot_slo_s": 0.05},
        }
    )
    spec = build_cluster_spec(config)
    assert spec.is_adaptive and spec.instance_ids() == ["adaptive-0", "adaptive-1", "adaptive-2"]
    worker = spec.worker_config("adaptive-2")
    assert worker.role.value == "adaptive" and worker.sends_kv and worker.receives_kv
    assert spec.router.latency_profile == profile and spec.router.default_tpot_slo_s == 0.05
    peers = spec.kv_peers("adaptive-1")
    assert peers.sources == peers.targets == {"adaptive-0": 1, "adaptive-2": 1}
    assert spec.kv_pairs() == [
        (a, b) for a in spec.instance_ids() for b in spec.instance_ids() if a != b
    ]
    assert isinstance(open_cluster(config, model_dir), RayCluster)


def _example_configs() -> dict[str, dict]:
    kuberay = list(yaml.safe_load_all((REPO_ROOT / "deploy" / "kuberay.yaml").read_text()))
    config_map = next(doc for doc in kuberay if doc["kind"] == "ConfigMap")
    return {
        "multinode.yaml": yaml.safe_load((REPO_ROOT / "deploy" / "multinode.yaml").read_text()),
        "kuberay.yaml": yaml.safe_load(config_map["data"]["pdserve.yaml"]),
    }


@pytest.mark.parametrize("name", ["multinode.yaml", "kuberay.yaml"])
def test_example_cluster_configs_use_only_valid_keys(
    name: str, tmp_path: Path, model_dir: str
) -> None:
    data = _example_configs()[name]
    (tmp_path / "token").write_text("t\n")
    data["model"] = model_dir  # the examples name a model folder on the cluster's nodes
    data["router"]["auth_token_file"] = str(tmp_path / "token")
    config = parse_config(data)
    assert (config.device, config.ray.address, config.router.host) == ("cuda", "auto", "0.0.0.0")
    assert (config.prefill.tensor_parallel_size, config.decode.instances) == (2, 4)
