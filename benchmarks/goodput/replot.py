"""Redraw a goodput run's plots from its summary.json alone (the raw records not needed):

    python -m benchmarks.goodput.replot benchmarks/results/goodput-2core.json [--out DIR]

Per regime, two charts: SLO attainment against the rate per device, each layout a line with
its goodput marked and the 90% target drawn, and goodput against the SLO scale. The latency
CDFs, TTFT breakdowns and placement charts need every request's timings: `pdserve bench`
draws those from its raw records (plots.py), which stay under benchmarks/runs/.
Writes {regime}_summary_attainment.png and {regime}_summary_scale.png into --out (default:
beside the summary) and prints their paths as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.goodput.plots import COLORS, _pyplot
from planner.metrics import ATTAINMENT_TARGET


def _layouts(entry: dict[str, Any]) -> list[str]:
    return [layout for layout in entry.get("points", {}) if entry["points"][layout]]


def _attainment(plt: Any, out_dir: Path, regime: str, entry: dict[str, Any]) -> Path:
    figure, axis = plt.subplots(figsize=(6, 4))
    for layout in _layouts(entry):
        points = entry["points"][layout]
        rates = [p["rate_per_device"] for p in points]
        attained = [100 * p["attainment"] for p in points]
        color = COLORS.get(layout, "gray")
        goodput = (entry.get("goodputs") or {}).get(layout) or 0.0
        axis.plot(rates, attained, "o-", color=color, label=f"{layout}: {goodput:.2f}")
        if goodput:
            axis.axvline(goodput, color=color, linestyle=":", linewidth=1)
    axis.axhline(100 * ATTAINMENT_TARGET, color="black", linestyle="--", linewidth=1)
    axis.set_xlabel("rate (requests/s per device)")
    axis.set_ylabel("SLO attainment (%)")
    axis.set_ylim(0, 105)
    axis.set_title(f"{regime}: attainment against rate (goodput in the legend)")
    axis.legend(fontsize=8)
    return _save(plt, figure, out_dir / f"{regime}_summary_attainment.png")


def _scale(plt: Any, out_dir: Path, regime: str, entry: dict[str, Any]) -> Path:
    by_scale = entry.get("goodput_by_scale") or {}
    scales = sorted(by_scale, key=float)
    figure, axis = plt.subplots(figsize=(6, 4))
    for layout in _layouts(entry):
        values = [(by_scale[s].get(layout) or {}).get("rate") or 0.0 for s in scales]
        axis.plot([float(s) for s in scales], values, "o-", color=COLORS.get(layout, "gray"))
        axis.lines[-1].set_label(layout)
    axis.set_xlabel("SLO scale")
    axis.set_ylabel("goodput (requests/s per device)")
    axis.set_title(f"{regime}: goodput against SLO scale")
    axis.legend(fontsize=8)
    return _save(plt, figure, out_dir / f"{regime}_summary_scale.png")


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def replot(summary_path: Path, out_dir: Path) -> list[str]:
    """Draw every regime of the summary; the files written."""
    summary = json.loads(summary_path.read_text())
    regimes = summary.get("regimes")
    if not regimes:
        raise SystemExit(f"{summary_path}: no 'regimes' entry; is it a pdserve bench summary?")
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for regime, entry in regimes.items():
        written.append(str(_attainment(plt, out_dir, regime, entry)))
        written.append(str(_scale(plt, out_dir, regime, entry)))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a pdserve bench summary.json")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs")
    args = parser.parse_args(argv)
    written = replot(args.summary, args.out or args.summary.parent)
    print(json.dumps({"plots": written}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
