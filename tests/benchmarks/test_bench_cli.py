"""`pdserve bench` parses into the benchmark's options and rejects bad ones with the reason."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.goodput.compare import _jsonable, _targets
from benchmarks.goodput.options import parse_bench_args, parse_target
from deploy.cli.main import main as pdserve


def test_bench_subcommand_carries_the_benchmark_options() -> None:
    args = parse_bench_args(
        [
            "--compare",
            "--out",
            "runs/x",
            "--quick",
            "--rates",
            "1,2.5",
            "--workloads",
            "code,chatbot",
            "--arrival",
            "gamma",
            "--cv",
            "2",
        ]
    )
    assert (args.compare, args.quick, str(args.out)) == (True, True, "runs/x")
    assert args.rates == (1.0, 2.5)
    assert args.workloads == ("code", "chatbot")
    assert (args.arrival, args.cv) == ("gamma", 2.0)
    config = json.loads(json.dumps(_jsonable(vars(args))))  # as summary.json records it
    assert config["out"] == "runs/x" and config["rates"] == [1.0, 2.5]
    assert "func" not in config


def test_unknown_workloads_and_bad_numbers_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_bench_args(["--out", "x", "--workloads", "poetry"])
    assert "unknown workload ['poetry']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_bench_args(["--out", "x", "--rates", "1,fast"])
    assert "expected numbers separated by commas" in capsys.readouterr().err


def test_pdserve_bench_forwards_to_the_benchmarks_own_command_line(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit):
        pdserve(["bench", "--help"])
    assert "usage: pdserve bench" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pdserve(["bench", "--out", "x", "--workloads", "poetry"])
    assert "unknown workload ['poetry']" in capsys.readouterr().err


def test_targets_name_a_layout_an_address_and_a_device_count() -> None:
    assert parse_target("colocated=10.0.0.2:50051:8") == ("colocated", "10.0.0.2:50051", 8)
    with pytest.raises(ValueError, match="LAYOUT=HOST:PORT:DEVICES"):
        parse_target("10.0.0.2:50051")


def test_both_layouts_get_one_engine_config_without_prefix_cache(tmp_path) -> None:
    from benchmarks.goodput.layouts import cluster_spec

    colocated = cluster_spec("colocated", tmp_path, chunk_size=256)
    split = cluster_spec("disaggregated", tmp_path, chunk_size=256)
    assert colocated.num_colocated_instances == 2 and colocated.pin_cpus
    assert (split.num_prefill_instances, split.num_decode_instances) == (1, 1)
    engine = colocated.colocated.engine
    assert engine == split.prefill.engine == split.decode.engine
    assert engine.enable_prefix_caching is False  # replayed prompts would hit
    assert engine.chunk_size == 256


def test_layouts_run_the_colocated_baseline_first_and_default_to_all_three() -> None:
    assert parse_bench_args(["--out", "x"]).layouts == ("colocated", "disaggregated", "adaptive")
    args = parse_bench_args(
        [
            "--out",
            "x",
            "--layouts",
            "adaptive,disaggregated,colocated",
            "--workloads",
            "mixed,shift",
        ]
    )
    assert args.layouts == ("colocated", "adaptive", "disaggregated")
    assert args.workloads == ("mixed", "shift")
    assert parse_bench_args(["--out", "x", "--layouts", "colocated, adaptive"]).layouts == (
        "colocated",
        "adaptive",
    )
    assert parse_bench_args(
        ["--out", "x", "--layouts", "adaptive", "--calibrate", "engine"]
    ).layouts == ("adaptive",)
    assert _targets(parse_bench_args(["--out", "x", "--layouts", "disaggregated,colocated"])) == [
        ("colocated", None, 2),
        ("disaggregated", None, 2),
    ]


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--layouts", "hybrid"], "unknown layout ['hybrid']"),
        (["--layouts", ","], "name at least one layout"),
        (["--layouts", "adaptive,disaggregated"], "calibrated through the colocated baseline"),
        (
            ["--layouts", "colocated", "--target", "colocated=h:1:2"],
            "--layouts picks local clusters",
        ),
        (["--latency-profile", "nowhere.json"], "--latency-profile nowhere.json: no such file"),
    ],
)
def test_bad_layout_choices_are_refused_with_the_reason(
    flags: list[str], reason: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        parse_bench_args(["--out", "x", *flags])
    assert reason in capsys.readouterr().err


def test_a_missing_profile_is_fine_when_the_adaptive_layout_does_not_run() -> None:
    args = parse_bench_args(
        ["--out", "x", "--layouts", "colocated,disaggregated", "--latency-profile", "nowhere.json"]
    )
    assert args.layouts == ("colocated", "disaggregated")


def test_the_adaptive_layout_gets_the_same_engine_and_kv_config_and_the_profile(tmp_path) -> None:
    from benchmarks.goodput.layouts import (
        DEFAULT_LATENCY_PROFILE,
        KV_START_TIMEOUT_S,
        cluster_spec,
    )
    from worker.protocol import Role

    adaptive = cluster_spec("adaptive", tmp_path, chunk_size=256)
    split = cluster_spec("disaggregated", tmp_path, chunk_size=256)
    assert adaptive.num_adaptive_instances == 2 and adaptive.pin_cpus
    assert adaptive.adaptive.role is Role.ADAPTIVE
    assert adaptive.adaptive.sends_kv and adaptive.adaptive.receives_kv
    assert adaptive.adaptive.engine == replace(split.prefill.engine, slo_scheduling=True)
    assert not split.prefill.engine.slo_scheduling and not split.decode.engine.slo_scheduling
    gated = cluster_spec("colocated-slo", tmp_path, chunk_size=256)
    assert gated.colocated.engine == adaptive.adaptive.engine  # the gate, without placement
    assert not cluster_spec("colocated", tmp_path, chunk_size=256).colocated.engine.slo_scheduling
    assert adaptive.adaptive.kv_transfer == split.prefill.kv_transfer == split.decode.kv_transfer
    assert adaptive.adaptive.kv_transfer.start_timeout_s == KV_START_TIMEOUT_S
    assert adaptive.router.latency_profile == str(DEFAULT_LATENCY_PROFILE)
    assert split.router.latency_profile is None
    other = tmp_path / "profile.json"
    other.write_text("{}")
    spec = cluster_spec("adaptive", tmp_path, pin_cpus=False, latency_profile=other)
    assert spec.router.latency_profile == str(other) and not spec.pin_cpus
