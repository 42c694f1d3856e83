"""Cold start: `pdserve serve` as a subprocess, from launch until gRPC health answers SERVING.

    python -m benchmarks.cold_start [--no-ray] [--config deploy/local.yaml] [--repeats 1]
                                    [--out cold_start.json]

The demo model is built (or found in the cache) before the clock starts; its build time is
reported on its own (`model_build_s`, 0 when cached). Each run launches a fresh `pdserve serve`
(default layout: deploy/local.yaml, one prefill instance at TP=2 and two decode instances),
polls the standard gRPC health service every 50 ms, records when each start-up line appeared,
then sends SIGTERM and times the shutdown. Target: <= 20 s on 2 CPU cores.
`stages_s` splits the time to SERVING by the start-up line that opened each stage (medians over
the runs): `imports` (launch to the CLI's first line: Python, torch, the config), `ray_start`,
`reserve_workers` (Ray's placement groups), `workers` (process spawn, imports and model load in
each worker, in parallel), `kv_channels` (Ray; plain processes form them inside `workers`),
`router`, `health` (the router's health turning SERVING).
Prints one JSON object as the last line and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from deploy.cli.client import RouterClient
from deploy.config.models import default_cache_dir, ensure_demo_model

REPO_ROOT = Path(__file__).resolve().parents[1]  # the served config's default, deploy/local.yaml

TARGET_S = 20.0
STAGES = (  # the start-up line that opens each stage, by its beginning
    ("starting Ray", "ray_start"),
    ("joining Ray", "ray_start"),
    ("reserving", "reserve_workers"),
    ("loading the model", "workers"),
    ("forming the KV channels", "kv_channels"),
    ("starting the router", "router"),
    ("starting ", "workers"),  # plain processes: "starting prefill-0 (TP=2): loading ..."
    ("waiting for the router's health", "health"),
)


def stages(progress: list[tuple[float, str]], serving_s: float) -> dict[str, float]:
    """Seconds per stage: from the line that opens it to the one that opens the next."""
    opened: list[tuple[float, str]] = [(0.0, "imports")]
    for t_s, line in progress:
        text = line.removeprefix("[pdserve] ")
        stage = next((name for prefix, name in STAGES if text.startswith(prefix)), None)
        if stage is not None and stage != opened[-1][1]:
            opened.append((t_s, stage))
    ends = [t for t, _ in opened[1:]] + [serving_s]
    spent: dict[str, float] = {}
    for (start, name), end in zip(opened, ends, strict=True):
        spent[name] = round(spent.get(name, 0.0) + end - start, 2)
    return spent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_model() -> tuple[str, float, bool]:
    """The demo model's folder, the seconds its build took, and whether it was cached."""
    cached = (default_cache_dir() / "demo-model" / "config.json").exists()
    started = time.perf_counter()
    model_dir = ensure_demo_model()
    return model_dir, time.perf_counter() - started, cached


def one_run(args: argparse.Namespace, model_dir: str, timeout_s: float) -> dict[str, Any]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "deploy.cli.main",
        "serve",
        "--config",
        args.config,
        "--model",
        model_dir,
        "--port",
        str(port),
        "--metrics-port",
        "0",
    ]
    if args.no_ray:
        command.append("--no-ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "proto")])}
    lines: list[tuple[float, str]] = []
    launched = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.perf_counter() - launched, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with RouterClient(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(timeout_s=timeout_s, poll_s=0.05)
        serving_s = time.perf_counter() - launched
    except TimeoutError as exc:
        process.kill()
        output = "\n".join(text for _, text in lines)
        raise RuntimeError(f"not SERVING in time; output:\n{output}") from exc
    stop_started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    exit_code = process.wait(120)
    reader.join(10)
    progress = [(t, line) for t, line in lines if "[pdserve]" in line and t <= serving_s]
    return {
        "cold_start_s": round(serving_s, 3),
        "stages_s": stages(progress, serving_s),
        "shutdown_s": round(time.perf_counter() - stop_started, 3),
        "exit_code": exit_code,
        "progress": [
            {"t_s": round(t, 2), "line": line} for t, line in lines if "[pdserve]" in line
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "deploy" / "local.yaml"))
    parser.add_argument("--no-ray", action="store_true", help="plain processes instead of Ray")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    model_dir, build_s, cached = build_model()
    load_before = os.getloadavg()[0]
    runs = [one_run(args, model_dir, args.timeout) for _ in range(args.repeats)]
    cold_starts = [float(run["cold_start_s"]) for run in runs]
    names = dict.fromkeys(name for run in runs for name in run["stages_s"])
    result = {
        "benchmark": "cold_start",
        "runtime": "processes" if args.no_ray else "ray",
        "config": os.path.relpath(args.config, REPO_ROOT),
        "num_cpus": len(os.sched_getaffinity(0)),
        "load_average_before": round(load_before, 2),  # other work on the machine slows start-up
        "load_average_after": round(os.getloadavg()[0], 2),
        "model_build_s": 0.0 if cached else round(build_s, 3),
        "model_was_cached": cached,
        "cold_start_s": statistics.median(cold_starts),
        "cold_start_all_s": cold_starts,
        "stages_s": {
            name: round(statistics.median(run["stages_s"].get(name, 0.0) for run in runs), 2)
            for name in names
        },
        "target_s": TARGET_S,
        "meets_target": statistics.median(cold_starts) <= TARGET_S,
        "runs": runs,
    }
    for run in runs:
        print("\n".join(f"  {p['t_s']:7.2f}s {p['line']}" for p in run["progress"]))
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
