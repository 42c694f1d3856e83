"""benchmarks/gpu_checks.sh against the GPU image: its bounds, and every step in a dry run.

The GPU image lacks ray, FastAPI, uvicorn, pydantic, starlette, grpcio-health-checking and
grpcio-reflection. `gpu_checks.sh --dry-run` runs every step on CPU with a tiny model and those
packages hidden (benchmarks/gpu_image/sitecustomize.py): each step must exit 0, so each pytest
group collects its files without an import error (its GPU tests skip on CPU), and the benchmark
modules run with the image's packages alone.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_checks.sh"
HIDER = REPO / "benchmarks" / "gpu_image"
ABSENT = ("ray", "fastapi", "uvicorn", "pydantic", "starlette", "grpc_health", "grpc_reflection")
DRY_RUN_ONLY = {"serve-cpu"}
PYTEST_STEPS = {"gpu-graphs", "gpu-engine", "gpu-nccl", "gpu-serving", "gpu-disaggregated"}
BENCHMARK_STEPS = {"env", "model", "steps", "anchor-pdserve", "anchor-transformers", "kv-quant"}
STEPS = PYTEST_STEPS | BENCHMARK_STEPS | DRY_RUN_ONLY | {"summary"}


def test_the_real_run_is_bounded_by_seven_minutes() -> None:
    text = SCRIPT.read_text()
    steps = re.findall(r"^\s*step ([\w-]+) (\d+) ", text, re.MULTILINE)
    probes = [int(b) for b in re.findall(r"\btimeout (\d+) ", text)]
    assert {name for name, _ in steps} == STEPS
    assert sum(int(b) for name, b in steps if name not in DRY_RUN_ONLY) + sum(probes) <= 420
    assert " -x" not in text  # one failing group must not end the others


def marks_gpu(path: Path) -> bool:
    """The file uses `pytest.mark.gpu` (read with ast: a mention in a string does not count)."""
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "gpu"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_every_gpu_test_file_runs_in_a_group() -> None:
    marked = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if marks_gpu(path)
    }
    assert "tests/engine/test_cuda.py" in marked
    assert marked <= set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))


def run_hidden(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(HIDER)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_simulated_image_hides_what_the_gpu_image_lacks() -> None:
    for code, absent in (
        ("import ray", "ray"),
        ("from grpc_health.v1 import health", "grpc_health"),
    ):
        failed = run_hidden(code)
        assert failed.returncode == 1 and f"No module named '{absent}'" in failed.stderr
    probe = run_hidden(
        "import importlib.metadata as md, importlib.util as u, sys\n"
        f"assert all(u.find_spec(m) is None for m in {ABSENT!r})\n"
        "assert not [d for d in md.distributions() if d.metadata['Name'] in ('ray', 'pdserve')]\n"
        "assert all(u.find_spec(m) for m in ('torch', 'transformers', 'grpc', 'yaml', 'pytest'))\n"
        "assert not [f for f in sys.meta_path if 'editable' in repr(f)]\n"
    )
    assert probe.returncode == 0, probe.stderr


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-dry-run")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=REPO,
        env={**env, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    codes = {p.name[3:-4]: int(p.read_text()) for p in out.glob("rc-*.txt")}
    return {"out": out, "stdout": done.stdout, "rc": done.returncode, "codes": codes}


def log_tail(run: dict[str, Any], step: str) -> str:
    return "\n".join((run["out"] / f"{step}.log").read_text().splitlines()[-20:])


@pytest.mark.slow
def test_every_step_of_the_dry_run_exits_0(dry_run: dict[str, Any]) -> None:
    assert set(dry_run["codes"]) == STEPS, dry_run["stdout"][-3000:]
    for step, rc in sorted(dry_run["codes"].items()):
        # pytest: 2 or 4 is a collection or usage error, 5 a group with no GPU test left
        assert rc == 0, f"{step}: rc {rc}\n{log_tail(dry_run, step)}"
    for step in PYTEST_STEPS:
        last = log_tail(dry_run, step).splitlines()[-1]  # "14 skipped, 3 deselected in 2.4s"
        assert "skipped" in last and not re.search(r"error|failed|passed", last), (step, last)


@pytest.mark.slow
def test_the_dry_run_ran_without_the_absent_packages(dry_run: dict[str, Any]) -> None:
    env = json.loads((dry_run["out"] / "env.json").read_text())
    assert set(ABSENT) <= set(env["missing"]) and env["gpu_name"] == "cpu"
    assert "1 passed" in log_tail(dry_run, "serve-cpu")  # the router served, not skipped


@pytest.mark.slow
def test_the_dry_run_summary_stays_in_its_folder(dry_run: dict[str, Any]) -> None:
    summary = json.loads((dry_run["out"] / "gpu-cpu.json").read_text())
    assert summary["exit_codes"] == {step: 0 for step in STEPS - {"summary"}}
    assert summary["anchor_tokens_per_s"] > 0 and summary["anchor_transformers_tokens_per_s"] > 0
    assert not (REPO / "benchmarks" / "results" / "gpu-cpu.json").exists()
