"""`pdserve bench` parses into the benchmark's options and rejects bad ones with the reason."""

from __future__ import annotations

import json

import pytest

from benchmarks.goodput.compare import _jsonable
from benchmarks.goodput.options import parse_bench_args, parse_target
from deploy.cli.main import main as pdserve


def test_bench_subcommand_carries_the_benchmark_options() -> None:
    args = parse_bench_args(
        ["--compare", "--out", "runs/x", "--quick", "--rates", "1,2.5",
         "--workloads", "code,chatbot", "--arrival", "gamma", "--cv", "2"]
    )  # fmt: skip
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
