"""The benchmark's command line (`pdserve bench` and `python -m benchmarks.goodput`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.goodput.report import DEFAULT_SLO_SCALES
from benchmarks.goodput.workloads import ARRIVALS, SHAPES

QUICK_REGIME = "summarization"  # long prompts, short outputs, tight TPOT: where disaggregation wins


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload {unknown}; choose from {list(SHAPES)}")
    return names


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of the benchmark, on a parser of the caller's (a subcommand's, say)."""
    add = parser.add_argument
    add("--compare", action="store_true",
        help="run the disaggregated layout and the colocated baseline side by side (default)")
    add("--out", type=Path, required=True, help="folder for raw JSON, summary.json and plots")
    add("--quick", action="store_true",
        help=f"a short run of the {QUICK_REGIME} regime only (< 5 min on 2 cores)")
    add("--workloads", type=_names, default=None,
        help=f"synthetic shapes to run, comma separated (default: all of {','.join(SHAPES)})")
    add("--sharegpt", type=Path, default=None,
        help="a ShareGPT-format JSON file: run it as the regime 'sharegpt' instead of shapes")
    add("--num-requests", type=int, default=None, help="requests per rate (default 50; quick 30)")
    add("--arrival", choices=ARRIVALS, default="poisson")
    add("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    add("--seed", type=int, default=0)
    add("--rates", type=_floats, default=(),
        help="explicit total rates (req/s, comma separated) instead of the adaptive sweep")
    add("--start-rate", type=float, default=None,
        help="first total rate of the adaptive sweep (default: from the calibration)")
    add("--growth", type=float, default=None,
        help="rate multiplier between sweep points (default 1.4; quick 1.6)")
    add("--max-points", type=int, default=None,
        help="most rates per layout before the refining one (default 6; quick 4)")
    add("--slo-scales", type=_floats, default=DEFAULT_SLO_SCALES)
    add("--calibrate", choices=("path", "engine"), default="path",
        help="what the SLO factors multiply: the colocated baseline's unloaded TTFT and TPOT "
        "through router and worker (path, default), or one engine alone in this process")
    add("--ttft-slo", type=float, default=None, help="seconds; default: shape factor x calibration")
    add("--tpot-slo", type=float, default=None, help="seconds; default: shape factor x calibration")
    add("--model-dir", type=Path, default=None,
        help="benchmark model folder (built there on first use; default ~/.cache/pdserve)")
    add("--model-size", choices=("bench", "tiny"), default="bench")
    add("--chunk-size", type=int, default=512, help="prefill chunk (both layouts)")
    add("--max-num-batched-tokens", type=int, default=2048, help="step token budget")
    add("--no-pin", action="store_true", help="do not pin each worker to its own core")
    add("--client-processes", type=int, default=1, help="load-driver processes (0: in-process)")
    add("--ray-address", default=None,
        help="run the load driver as Ray tasks spread over this cluster's nodes")
    add("--target", action="append", default=[], metavar="LAYOUT=HOST:PORT:DEVICES",
        help="benchmark a running router instead of starting local clusters (repeatable)")


def parse_bench_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Goodput under SLOs: disaggregated prefill/decode against colocated.",
    )
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def parse_target(text: str) -> tuple[str, str, int]:
    """"colocated=10.0.0.2:50051:8" -> ("colocated", "10.0.0.2:50051", 8)."""
    try:
        layout, rest = text.split("=", 1)
        address, devices = rest.rsplit(":", 1)
        return layout, address, int(devices)
    except ValueError:
        raise ValueError(
            f"--target {text!r} must look like LAYOUT=HOST:PORT:DEVICES, "
            "e.g. disaggregated=10.0.0.1:50051:8"
        ) from None
