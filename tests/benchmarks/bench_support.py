"""A short `pdserve bench --compare` on the tiny model, for the end-to-end benchmark tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.goodput.compare import run_benchmark
from benchmarks.goodput.options import parse_bench_args


def run_bench(
    tmp_path_factory: pytest.TempPathFactory, regime: str, *flags: str
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Run `regime` on local clusters of the tiny model; (summary, its raw file, the out dir)."""
    out = tmp_path_factory.mktemp(f"bench-{regime}")
    args = parse_bench_args(
        [
            "--compare",
            "--out",
            str(out),
            "--model-dir",
            str(out / "model"),
            "--model-size",
            "tiny",
            "--workloads",
            regime,
            *flags,
        ]
    )
    summary = run_benchmark(args)
    raw = json.loads((out / "raw" / f"{regime}.json").read_text())
    return summary, raw, out
