"""The GPU check script's shape, and its benchmark modules run on CPU at a tiny size.

benchmarks/gpu_checks.sh ends in the summary (its bounds: test_gpu_checks.py); the modules it
calls print their JSON on CPU too (the figures themselves come from a GPU run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_anchor, gpu_model, gpu_steps, gpu_summary

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "benchmarks" / "gpu_checks.sh").read_text()


def test_the_script_runs_the_benchmarks_and_the_summary() -> None:
    # Its bounds and steps: tests/benchmarks/test_gpu_checks.py.
    assert 'timeout "$limit"' in SCRIPT
    for needed in ("-m gpu", "gpu_anchor", "gpu_steps", "gpu_summary", "test_gpu_disaggregated"):
        assert needed in SCRIPT


def test_the_summary_keeps_the_named_fields(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "env.json").write_text(json.dumps({"gpu_name": "NVIDIA H100 80GB HBM3"}))
    (run / "anchor-pdserve.json").write_text(json.dumps({"tokens_per_s": 15100.0}))
    (run / "steps.json").write_text(json.dumps({"decode_step_roofline_ratio_b64": 2.4}))
    (run / "rc-steps.txt").write_text("0\n")
    results = tmp_path / "results"
    results.mkdir()
    summary = gpu_summary.main(["--run-dir", str(run), "--results", str(results)])
    written = json.loads((results / "gpu-h100.json").read_text())
    assert written == summary
    assert summary["gpu_kind"] == "h100"
    assert summary["anchor_tokens_per_s"] == 15100.0
    assert summary["decode_step_roofline_ratio_b64"] == 2.4
    assert summary["anchor_transformers_tokens_per_s"] is None
    assert summary["exit_codes"] == {"steps": 0}


@pytest.mark.slow
def test_the_benchmarks_run_on_cpu(tmp_path: Path) -> None:
    model = tmp_path / "model"
    gpu_model.main(["--model-dir", str(model), "--preset", "31m", "--device", "cpu"])
    common = ["--model-dir", str(model), "--device", "cpu", "--dtype", "float32"]
    steps = gpu_steps.main(
        [*common, "--batch-sizes", "1,4", "--steps", "1", "--context-len", "40"]
        + ["--variants", "default"]
    )
    assert set(steps["variants"]["default"]["batches"]) == {"1", "4"}
    anchor = gpu_anchor.main(
        [*common, "--num-seqs", "3", "--max-len", "110", "--runs", "1", "--kv-cache-gb", "0.1"]
    )
    assert anchor["tokens_per_s"] > 0 and anchor["num_output_tokens"] >= 300
