"""The summary of one `benchmarks/gpu_checks.sh` run: benchmarks/results/gpu-<kind>.json.

Reads what the script's steps wrote into its output folder (env.json, steps.json,
anchor-pdserve.json, anchor-transformers.json, rc-*.txt) and keeps the figures a reader
compares: gpu_kind, anchor_tokens_per_s (pdserve's median of three), the transformers figure,
decode_step_roofline_ratio_b64, per-step host/GPU/wall times and launches per variant, and
each step's exit status. A missing file leaves its fields null.

    python -m benchmarks.gpu_summary --run-dir gpu-out [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


def gpu_kind(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100"; unknown names become a lower-case slug."""
    match = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _load(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    except (OSError, ValueError):
        return None


def summarize(run_dir: Path) -> dict[str, Any]:
    env = _load(run_dir / "env.json") or {}
    steps = _load(run_dir / "steps.json") or {}
    ours = _load(run_dir / "anchor-pdserve.json") or {}
    theirs = _load(run_dir / "anchor-transformers.json") or {}
    name = env.get("gpu_name") or steps.get("gpu") or "unknown"
    exit_codes = {
        path.name.removeprefix("rc-").removesuffix(".txt"): int(path.read_text().strip() or -1)
        for path in sorted(run_dir.glob("rc-*.txt"))
    }
    return {
        "gpu_kind": gpu_kind(name),
        "gpu_name": name,
        "date": env.get("date"),
        "driver": env.get("driver"),
        "cuda": env.get("cuda"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "transformers": env.get("transformers"),
        "anchor_tokens_per_s": ours.get("tokens_per_s"),
        "anchor_runs_tokens_per_s": ours.get("runs_tokens_per_s"),
        "anchor_transformers_tokens_per_s": theirs.get("tokens_per_s"),
        "anchor_engine": {k: ours.get(k) for k in ("backend", "cuda_graphs", "fused_ops")},
        "decode_step_roofline_ratio_b64": steps.get("decode_step_roofline_ratio_b64"),
        "decode_step_roofline_ms_b64": steps.get("decode_step_roofline_ms_b64"),
        "hbm_bandwidth_spec": steps.get("hbm_bandwidth_spec"),
        "hbm_bandwidth_measured": steps.get("hbm_bandwidth_measured"),
        "steps_context_len": steps.get("context_len"),
        "steps": {v: row.get("batches") for v, row in steps.get("variants", {}).items()},
        "exit_codes": exit_codes,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    summary = summarize(args.run_dir)
    text = json.dumps(summary, indent=1) + "\n"
    for folder in (args.results, args.run_dir):
        (folder / f"gpu-{summary['gpu_kind']}.json").write_text(text)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
