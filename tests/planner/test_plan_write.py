"""`pdserve plan --write` writes a config that deploy.config.serve_config loads; `serve` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.serve_config import load_config
from planner.cli import build_parser, cmd_plan
from planner.placement import Parallel, Placement
from planner.profile import ModelProfile, TPProfile, save_profiles
from planner.serve_config import serve_config_dict
from tests.deploy.test_cli import START_TIMEOUT_S, Child
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model


def _profile_file(tmp_path: Path) -> Path:
    """TP1 only; prefill and decode both cheap, so the search has a clear answer quickly."""
    one = TPProfile((1.0, 0.1, 0.0), (5.0, 0.0, 0.0), (5.0, 0.0, 0.0))
    path = tmp_path / "profile.json"
    save_profiles(path, {"tiny": ModelProfile("tiny", {1: one})})
    return path


def _plan(tmp_path: Path, *extra: str) -> dict:
    args = build_parser().parse_args(
        [
            "--profile",
            str(_profile_file(tmp_path)),
            "--gpus-per-node",
            "2",
            "--workload",
            "code",
            "--num-requests",
            "200",
            "--ttft-ms",
            "300",
            "--tpot-ms",
            "40",
            *extra,
        ]
    )
    assert cmd_plan(args) == 0
    return args


def test_plan_write_output_loads_with_the_serve_config_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.yaml"
    base = tmp_path / "base.yaml"
    base.write_text("kv_cache: {num_blocks: 64}\nrouter: {port: 0}\n")
    _plan(tmp_path, "--write", str(out), "--base-config", str(base))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = load_config(out)
    best = summary["best"]["placement"]
    if config.mode == "colocated":
        assert best == f"colocated tp=1 pp=1 x{config.colocated.instances}"
    else:
        assert best == (
            f"prefill tp=1 pp=1 x{config.prefill.instances}, "
            f"decode tp=1 pp=1 x{config.decode.instances}"
        )
    assert config.kv_cache.num_blocks == 64  # the base config's other keys stay


def test_a_pipelined_placement_is_refused_with_what_to_do() -> None:
    placement = Placement("disaggregated", Parallel(2, 2), Parallel(1, 1))
    with pytest.raises(ValueError, match="plan with --pp 1"):
        serve_config_dict(placement)


@pytest.mark.slow
def test_written_config_starts_a_cluster_that_serves(tmp_path: Path) -> None:
    model_dir = add_tiny_tokenizer(make_tiny_model(tmp_path / "model", "llama"))
    out = tmp_path / "serve.yaml"
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {model_dir}\nkv_cache: {{num_blocks: 64}}\n")
    _plan(tmp_path, "--write", str(out), "--base-config", str(base))
    child = Child.start(
        "serve", "--config", str(out), "--no-ray", "--port", "0", "--metrics-port", "0"
    )
    try:
        match = child.wait_for_line(r"serving on (\S+), metrics", START_TIMEOUT_S)
        request = pb.GenerateRequest(prompt="The quick brown fox", max_tokens=4, ignore_eos=True)
        with grpc.insecure_channel(match.group(1)) as channel:
            reply = pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=60)
        assert len(reply.token_ids) == 4
    finally:
        child.kill()


def test_plan_takes_the_sharegpt_lengths_file_and_searches_chunked_colocated_at_pp_1(
    tmp_path, capsys
) -> None:
    """The command line's defaults (pp 1,2,4,8; the chunked colocated policy) once failed with
    'the chunked colocated policy models pp = 1 only'; a lengths file keeps its pairs under
    "pairs"."""
    from deploy.cli.main import main

    root = Path(__file__).resolve().parents[2]
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"pairs": [[700, 90], [300, 200], [1200, 40]] * 20}))
    code = main(
        [
            "plan",
            "--profile",
            str(root / "benchmarks/data/distserve/profiler-a100-80g.distserve.json"),
            "--model",
            "facebook/opt-13b",
            "--gpus-per-node",
            "2",
            "--workload",
            str(lengths),
            "--num-requests",
            "60",
            "--ttft-ms",
            "400",
            "--tpot-ms",
            "100",
        ]
    )
    assert code in (0, None)
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["best_colocated"]["placement"].endswith("pp=1 x1")
    assert plan["best"]["per_gpu_goodput"] > 0
