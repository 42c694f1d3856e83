"""Soak: 10,000 requests with 10% cancelled (and 10% on short deadlines), no faults; what leaks?

    python -m benchmarks.soak [--num-requests 10000] [--concurrency 16] [--out soak.json]

The cluster and the load are the chaos benchmark's (benchmarks/chaos.py: one prefill instance
at TP=2 and two decode instances in plain processes, the demo model in float64, the load in a
child process), without the faults. Memory is read twice: after a warm-up of 500 requests (the
allocator and the caches have reached their working size by then) and at the end.

The last line printed is one JSON object (also written to --out): the request counts of the
chaos benchmark, `errors` (anything but a finished stream, a client's own cancel or deadline),
`leaked_blocks` once the load has stopped, and `rss_growth_pct` per process kind (router,
prefill, decode) from the warm-up to the end; `ok` when nothing failed and nothing leaked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.chaos import cluster_spec, leaked_blocks, prompts, reference
from benchmarks.chaos_faults import rss_by_kind
from benchmarks.chaos_load import classify, run_load
from benchmarks.output import emit
from deploy.config.models import resolve_model
from deploy.runtime.local.local_cluster import LocalCluster

WARM_UP_REQUESTS = 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--model", default="demo", help="model folder (default: the demo)")
    parser.add_argument("--time-limit-s", type=float, default=3600.0, help="the load's bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON result here too")
    return parser.parse_args(argv)


def _load(
    address: str, args: argparse.Namespace, prompt_set: list[list[int]], num: int, seed: int
) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(
        target=run_load,
        args=(
            child,
            address,
            prompt_set,
            args.max_tokens,
            args.time_limit_s,
            args.concurrency,
            seed,
            num,
        ),
    )
    process.start()
    records = parent.recv() if parent.poll(args.time_limit_s + 400) else []
    process.join(30)
    return list(records)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = resolve_model(args.model)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    with LocalCluster(cluster_spec(model_dir)) as cluster:
        address = cluster.start()
        prompt_set = prompts(args.num_prompts, vocab_size, args.seed)
        expected = reference(address, prompt_set, args.max_tokens)
        warm = _load(address, args, prompt_set, WARM_UP_REQUESTS, args.seed)
        rss_start = rss_by_kind(cluster)
        began = time.monotonic()
        records = _load(address, args, prompt_set, args.num_requests, args.seed + 1)
        seconds = time.monotonic() - began
        leaked = leaked_blocks(cluster)
        rss_end = rss_by_kind(cluster)
    counts = classify(warm + records, expected)
    errors = counts["requests"] - counts["completed"] - counts["cancelled_by_client"]
    errors -= counts["client_deadline"]
    growth = {k: round(100.0 * (rss_end[k] - v) / v, 1) for k, v in rss_start.items() if v}
    result = {
        **{key: value for key, value in counts.items() if key != "examples"},
        "errors": errors,
        "leaked_blocks": leaked,
        "rss_mib_start": rss_start,
        "rss_mib_end": rss_end,
        "rss_growth_pct": growth,
        "seconds": round(seconds, 1),
        "requests_per_s": round(len(records) / seconds, 1) if seconds else 0.0,
        "examples": counts["examples"],
    }
    result["ok"] = (
        errors == 0
        and leaked == 0
        and counts["repeated_or_skipped_tokens"] == 0
        and len(records) == args.num_requests
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
