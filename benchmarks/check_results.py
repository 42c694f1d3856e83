"""Re-measure the figures of docs/results.md and list every one that moved past its tolerance.

    python -m benchmarks.check_results [--quick] [--only NAME ...] [--budget-s 1200]
                                       [--out PATH]

Runs the command behind each figure of benchmarks/figures.py (one run per distinct command line;
--quick: the quick variant where one measures the same figure, and leaves out the commands too
long for it), each as a subprocess with `--out`, and reads the figure from that JSON. A command
that would not finish inside what is left of --budget-s is not started: it is listed under
`not_run`, never silently passed. Prints one line per figure, then one JSON object on the last
line: `moved` (recorded, measured, tolerance, the command to rerun), `failed` (a command that
exited non-zero, timed out, or printed no such key), `not_run`, and every figure `checked`.
Exit status 0 whatever moved: the JSON is the verdict. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.figures import FIGURES, Figure, by_command
from benchmarks.output import emit

REPO_ROOT = Path(__file__).resolve().parents[1]


def lookup(result: dict[str, Any], key: str) -> float:
    value: Any = result
    for part in key.split("."):
        value = value[part]
    return float(value)


def run_command(argv: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """The command's JSON (from its --out file), or None and why not."""
    with tempfile.TemporaryDirectory(prefix="pdserve-check-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", *argv, "--out", str(out)]
        try:
            done = subprocess.run(
                command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout_s:.0f} s"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return None, f"exit code {done.returncode}: " + " | ".join(tail)
        if not out.exists():
            return None, "wrote no --out file"
        return json.loads(out.read_text()), ""


def check(figures: tuple[Figure, ...], quick: bool, budget_s: float) -> dict[str, Any]:
    started = time.perf_counter()
    checked: list[dict[str, Any]] = []
    moved: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    not_run: list[dict[str, Any]] = []
    groups = by_command(figures, quick)
    for argv, group in groups.items():
        expected_s = sum(f.seconds for f in group)
        left_s = budget_s - (time.perf_counter() - started)
        command = "python -m " + " ".join(argv)
        if expected_s > left_s:
            reason = f"needs about {expected_s:.0f} s, {max(left_s, 0):.0f} s of the budget left"
            not_run += [{"figure": f.name, "command": command, "reason": reason} for f in group]
            continue
        run_started = time.perf_counter()
        result, error = run_command(list(argv), timeout_s=min(left_s, max(3 * expected_s, 120)))
        seconds = round(time.perf_counter() - run_started, 1)
        for figure in group:
            row: dict[str, Any] = {
                "figure": figure.name,
                "command": command,
                "recorded": figure.recorded,
                "tolerance": figure.tolerance,
                "seconds": seconds,
            }
            try:
                if result is None:
                    raise LookupError(error)
                row["measured"] = round(lookup(result, figure.key), 4)
            except (LookupError, TypeError, ValueError) as exc:
                failed.append({**row, "error": str(exc) or f"no key {figure.key!r}"})
                continue
            checked.append(row)
            if figure.moved(row["measured"]):
                moved.append(row)
            print(
                f"{figure.name}: {row['measured']} (recorded {figure.recorded}, "
                f"±{figure.tolerance:.0%}){'  MOVED' if figure.moved(row['measured']) else ''}",
                flush=True,
            )
    return {
        "benchmark": "check_results",
        "quick": quick,
        "commit": _commit(),
        "load_average": round(os.getloadavg()[0], 2),
        "num_figures": len(figures),
        "moved": moved,
        "failed": failed,
        "not_run": not_run,
        "checked": checked,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick variants; skip long ones")
    parser.add_argument("--only", nargs="*", default=None, help="figure names to check")
    parser.add_argument("--budget-s", type=float, default=1200.0, help="for all the commands")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    figures = FIGURES
    if args.only:
        unknown = set(args.only) - {f.name for f in FIGURES}
        if unknown:
            parser.error(f"no such figure: {', '.join(sorted(unknown))}")
        figures = tuple(f for f in FIGURES if f.name in args.only)
    result = check(figures, args.quick, args.budget_s)
    emit(result, args.out)


if __name__ == "__main__":
    main()
