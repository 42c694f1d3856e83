"""Load with cancels against a cluster this script starts: does it keep serving, honestly?

    python -m benchmarks.load_cancel [--scale 0.1] [--no-ray] [--config my.yaml] --out run.json

`pdserve serve` starts as a child process (deploy/local.yaml's layout unless --config: one
prefill instance at TP=2, two decode instances, on Ray unless --no-ray), then this sequence,
each count times --scale:

    1. 600 concurrent streams                 4. 2,000 short requests, 10% cancelled
    2. 1,500 concurrent streams                  (at most 200 in flight)
    3. 200 long streams, half cancelled within 3 s

While it runs, a monitor asks gRPC health twice a second and sends a one-token probe every two
seconds: health "lies" when it says SERVING while a probe fails for a reason other than
overload (RESOURCE_EXHAUSTED), or NOT_SERVING while probes succeed. At the end every worker's
KV pool (the router's `pdserve:kv_blocks_used` gauges) must be back at its count from before
the load within a second, and serve must stop on SIGTERM. Every wait is bounded: each request
has a deadline and the whole run --time-limit-s.

The last line printed is one JSON object (also written to --out): errors by status code per
phase (OK, RESOURCE_EXHAUSTED and our own cancels are not errors), health samples and lies,
pool counts before and after, and `ok` when there were no errors, no lies and the pools
returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.load_cancel_run import (
    PHASES,
    PhaseResult,
    Server,
    monitor_health,
    run_phase,
    wait_for_pools,
)
from benchmarks.output import emit

_NOT_ERRORS = ("OK", "RESOURCE_EXHAUSTED", "CANCELLED_BY_CLIENT")
LAYOUT: dict[str, Any] = {
    "prefill": {"instances": 1, "tensor_parallel_size": 2},
    "decode": {"instances": 2},
    "kv_cache": {"memory_mb": 64},
    "router": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="load_cancel", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every count")
    parser.add_argument("--no-ray", action="store_true", help="workers as plain processes")
    parser.add_argument("--model", default="demo", help="model folder (default: the demo)")
    parser.add_argument("--config", help="YAML merged over the default layout (section-wise)")
    parser.add_argument("--out", help="write the JSON result here too")
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="the whole run")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 10:
        parser.error("--scale must be in (0, 10]")
    return args


def serve_config(args: argparse.Namespace, folder: Path) -> Path:
    """The config file serve starts from: LAYOUT, the user's --config over it, the model."""
    data: dict[str, Any] = {key: dict(value) for key, value in LAYOUT.items()}
    if args.config:
        for key, value in (yaml.safe_load(Path(args.config).read_text()) or {}).items():
            merged = isinstance(value, dict) and isinstance(data.get(key), dict)
            data[key] = {**data[key], **value} if merged else value
    data["model"] = args.model_dir
    data.setdefault("ray", {})["enabled"] = not args.no_ray
    path = folder / "load_cancel.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def run_sequence(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """Warm up, note the pools, run every phase under the monitor, check the pools."""
    deadline = time.monotonic() + args.time_limit_s
    await server.warm_up()
    before = await server.settled_pools()
    stop = asyncio.Event()
    monitor = asyncio.create_task(monitor_health(server, stop))
    phases: list[PhaseResult] = []
    try:
        for index, phase in enumerate(PHASES):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            scaled = phase.scaled(args.scale)
            result = await run_phase(
                server, scaled, args.request_timeout_s, args.seed + index, left
            )
            phases.append(result)
            print(f"[load_cancel] {result.summary()}", flush=True)
    finally:
        stop.set()
        health = await monitor
    pools = await wait_for_pools(server, before, settle_s=1.0)
    return {"phases": phases, "health": health, "pools": pools, "pools_before": before}


def report(args: argparse.Namespace, outcome: dict[str, Any], stopped: dict[str, Any]) -> dict:
    phases: list[PhaseResult] = outcome["phases"]
    errors: dict[str, int] = {}
    for phase in phases:
        for code, count in phase.codes.items():
            if code not in _NOT_ERRORS:
                errors[code] = errors.get(code, 0) + count
    health, pools = outcome["health"], outcome["pools"]
    complete = len(phases) == len(PHASES)
    return {
        "runtime": "processes" if args.no_ray else "ray",
        "scale": args.scale,
        "complete": complete,
        "phases": [phase.as_dict() for phase in phases],
        "errors": errors,
        "num_errors": sum(errors.values()),
        "health": health,
        "pools": {**pools, "before": outcome["pools_before"]},
        "shutdown": stopped,
        "ok": complete
        and not errors
        and health["num_lies"] == 0
        and pools["returned"]
        and stopped["exit_code"] == 0,
    }


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from deploy.config.models import resolve_model

    args = parse_args(argv)
    args.model_dir = resolve_model(args.model)
    model_config = json.loads((Path(args.model_dir) / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="load-cancel-") as folder:
        server = Server.start(serve_config(args, Path(folder)), start_timeout_s=300)
        server.vocab_size = int(model_config["vocab_size"])
        try:
            outcome = asyncio.run(run_sequence(args, server))
        finally:
            stopped = server.stop()
    result = report(args, outcome, stopped)
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
