"""A third-party benchmark tool against pdserve's OpenAI-compatible HTTP API, checked against
`pdserve bench` on the same load.

    python -m benchmarks.third_party [--aiperf PATH] [--rate 1] [--num-requests 100] \
        [--isl 128] [--osl 32] [--out DIR]

The tool is NVIDIA's AIPerf (`pip install aiperf`, in a virtual environment of its own: it pins
its own versions of common packages). It installs from PyPI alone, speaks the OpenAI completions
API with streaming, takes a local tokenizer folder, and sends requests at a given rate with
fixed input and output lengths, as `pdserve bench` does. (guidellm installs from PyPI too; it
was not tried here.)

Both send at a constant rate: two tools' Poisson draws differ, and on a few dozen requests the
queueing that different bursts cause would swamp what is being compared. AIPerf counts output
tokens with the server's usage (--use-server-token-count): re-tokenizing the text of a
random-weight model counts about 1.5x the tokens it generated.

One disaggregated cluster (the benchmark model, 1 prefill + 1 decode, router with HTTP on), then
the same load three times: `pdserve bench`'s HTTP client (benchmarks/goodput/http_client.py,
random token prompts of --isl tokens), AIPerf (synthetic text prompts of --isl tokens by the
same tokenizer), and `pdserve bench` again. All ask for --osl tokens with ignore_eos. The last
line is one JSON object: each side's TTFT (mean, median) and output tokens/s, their ratios, and
`agree` (mean TTFT and tokens/s both within 10%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.goodput import layouts
from benchmarks.goodput.compare import DEFAULT_MODEL_DIR
from benchmarks.goodput.driver import LoadDriver
from benchmarks.goodput.http_client import STREAM_OPTIONS
from benchmarks.goodput.sweep import warm_up
from benchmarks.goodput.workloads import build_requests, random_prompts
from planner.metrics import RequestRecord, ttft
from planner.traffic import arrival_offsets

TOLERANCE = 0.10


def summarize(records: list[RequestRecord]) -> dict[str, float]:
    """Mean TTFT (s) and output tokens/s from the first send to the last token."""
    done = [r for r in records if r.ok]
    if not done:
        raise RuntimeError(f"every request failed: {records[0].error if records else ''}")
    began = min(r.send_time for r in done)
    ended = max(r.token_times[-1] for r in done)
    return {
        "ttft_mean_s": statistics.mean(ttft(r) for r in done),
        "ttft_p50_s": statistics.median(ttft(r) for r in done),
        "output_tokens_per_s": sum(len(r.token_times) for r in done) / (ended - began),
        "num_ok": len(done),
    }


def pdserve_bench(url: str, args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    lengths = [(args.isl, args.osl)] * args.num_requests
    prompts = random_prompts(lengths, layouts.prompt_token_range(model_dir), args.seed)
    gaps = [1.0] * args.num_requests  # constant rate, as AIPerf's --request-rate-mode constant
    requests = build_requests(prompts, arrival_offsets(gaps, args.rate), "pdserve-bench")
    with LoadDriver(num_processes=1) as driver:
        warm_up(driver, url, prompts)
        return summarize(driver.run(url, requests))


def aiperf(url: str, args: argparse.Namespace, model_dir: Path, model_name: str) -> dict[str, Any]:
    out = args.out / "aiperf"
    shutil.rmtree(out, ignore_errors=True)
    command = [
        args.aiperf,
        "profile",
        "--model",
        model_name,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        str(model_dir),
        "--isl",
        str(args.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.osl),
        "--osl-stddev",
        "0",
        "--request-rate",
        str(args.rate),
        "--request-rate-mode",
        "constant",
        "--use-server-token-count",
        "--request-count",
        str(args.num_requests),
        "--warmup-request-count",
        "4",
        # The same stream options as pdserve bench's client (http_client.STREAM_OPTIONS): a
        # chunk for every token. (--per-chunk-usage does this on AIPerf's chat endpoint only.)
        "--extra-inputs",
        json.dumps({"ignore_eos": True, "stream_options": STREAM_OPTIONS}),
        "--random-seed",
        str(args.seed),
        "--artifact-dir",
        str(out),
        "--ui-type",
        "none",
        "--no-server-metrics",
        # One worker and one record processor: on a small machine AIPerf's services would
        # otherwise take the cores the server runs on.
        "--workers-max",
        "1",
        "--record-processors",
        "1",
    ]
    subprocess.run(command, check=True, timeout=args.timeout_s)
    summary_file = out / "profile_export_aiperf.json"
    metrics = json.loads(summary_file.read_text())
    return {
        "ttft_mean_s": _metric(metrics, "time_to_first_token") / 1000.0,  # reported in ms
        "ttft_p50_s": _metric(metrics, "time_to_first_token", "p50") / 1000.0,
        "output_tokens_per_s": _metric(metrics, "output_token_throughput"),
        "summary_file": str(summary_file),
    }


def _metric(metrics: dict[str, Any], name: str, stat: str = "avg") -> float:
    """A metric's statistic from AIPerf's summary JSON (flat, or under "records")."""
    entry = metrics.get(name) or metrics.get("records", {}).get(name)
    if entry is None:
        raise KeyError(f"AIPerf's summary has no {name!r}; keys: {sorted(metrics)[:20]}")
    return float(entry[stat])


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = layouts.ensure_bench_model(DEFAULT_MODEL_DIR)
    spec = layouts.cluster_spec("disaggregated", model_dir, pin_cpus=False)
    spec = dataclasses.replace(spec, router=dataclasses.replace(spec.router, http_port=0))
    cluster = layouts.start_local_cluster(spec)
    try:
        url = f"http://127.0.0.1:{cluster.router.http_port}"
        before = pdserve_bench(url, args, model_dir)
        theirs = aiperf(url, args, model_dir, cluster.router.config.model_name)
        after = pdserve_bench(url, args, model_dir)
    finally:
        cluster.shutdown()
    # pdserve bench runs before and after AIPerf: their mean cancels a load that drifts
    # steadily on a shared machine, and their spread shows how much it moved.
    ours = {key: (before[key] + after[key]) / 2 for key in before}
    keys = ("ttft_mean_s", "ttft_p50_s", "output_tokens_per_s")
    ratios = {key: theirs[key] / ours[key] for key in keys}
    return {
        "tool": "aiperf",
        "rate": args.rate,
        "num_requests": args.num_requests,
        "isl": args.isl,
        "osl": args.osl,
        "pdserve_bench": ours,
        "aiperf": theirs,
        "pdserve_bench_before": before,
        "pdserve_bench_after": after,
        "ratio_aiperf_over_pdserve": ratios,
        "agree": all(
            abs(ratios[key] - 1.0) <= TOLERANCE for key in ("ttft_mean_s", "output_tokens_per_s")
        ),
        "finished_at": time.time(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (constant)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--isl", type=int, default=128, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=32, help="output tokens (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=Path("runs/third_party"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
