"""Chaos: a steady load with cancels and deadlines while faults pile up; does anything get lost?

    python -m benchmarks.chaos [--runtime plain|ray] [--mode disaggregated|adaptive|colocated]
                               [--duration-s 240] [--fault-every-s 20] [--out chaos.json]

This process hosts the cluster and its router as `pdserve serve` does (`--runtime`: worker
processes, or actors on a local Ray cluster). `--mode` disaggregated: a prefill instance at TP=2
and two decode instances; adaptive or colocated: two instances at TP=1. The demo model runs in
float64, so a migrated greedy stream must equal the undisturbed one, the reference generated
first. While the load runs (in a child process, benchmarks/chaos_load.py), a fault every
--fault-every-s (x0.5 to x1.5), in turn from those the layout has (chaos_faults.faults_for):

    kill_worker       SIGKILL a decode worker (any instance's worker without decode instances)
    kill_tp_rank      SIGKILL one TP rank of an instance at TP>1 (the driver or another rank)
    stop_worker       SIGSTOP a worker for longer than the KV deadlines, then SIGCONT
    drop_kv_channel   abort a TCP connection between a KV source's ranks and its target
                      (`ss -K`: the KV channel's sockets; needs the kernel's sock_destroy)
After each it waits until every instance is healthy, routable and SERVING (`heal_s`).

The last line printed is one JSON object (also written to --out):
  requests, completed, faults_injected, faults (each with its kind, target, heal_s)
  failed_before_first_token  clients with an error and no token (RESOURCE_EXHAUSTED: `overloaded`)
  lost_streams               streams that got tokens and then no final message
  migrated, retried          requests whose final timings report a migration / a retry
  repeated_or_skipped_tokens streams whose tokens are not (a prefix of) the reference
  migration_completed_pct    of streams a loss hit after a first token, those migrated
  leaked_blocks              KV blocks still in use on every worker once the load has stopped
  hangs                      requests with no status by their deadline (+10 s)
  rss_growth_pct             per process kind (router and each role), end over start
  ok                         every target met
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from benchmarks.chaos_faults import Faults, faults_for, loads, rss_by_kind
from benchmarks.chaos_load import classify, run_load
from benchmarks.goodput.layouts import DEFAULT_LATENCY_PROFILE
from benchmarks.output import emit
from deploy.config.cluster_spec import ClusterSpec, build_cluster_spec
from deploy.config.models import resolve_model
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster
from deploy.runtime.router_host import ServingCluster

KV_DEADLINE_S = 3.0  # transfer and start deadlines, the router's worker timeout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=240.0, help="how long the load runs")
    parser.add_argument("--fault-every-s", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=8, help="clients, one stream each")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--model", default="demo", help="model folder (default: the demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runtime", choices=("plain", "ray"), default="plain")
    parser.add_argument(
        "--mode", choices=("disaggregated", "adaptive", "colocated"), default="disaggregated"
    )
    parser.add_argument("--out", help="write the JSON result here too")
    return parser.parse_args(argv)


LAYOUTS: dict[str, dict[str, Any]] = {
    "disaggregated": {
        "prefill": {"instances": 1, "tensor_parallel_size": 2},
        "decode": {"instances": 2},
    },
    "adaptive": {"mode": "adaptive", "adaptive": {"instances": 2}},
    "colocated": {"mode": "colocated", "colocated": {"instances": 2}},
}


def cluster_spec(
    model_dir: str, mode: str = "disaggregated", runtime: str = "plain"
) -> ClusterSpec:
    router: dict[str, Any] = {"port": 0, "worker_timeout_s": KV_DEADLINE_S, "shutdown_grace_s": 1.0}
    if mode == "adaptive":
        router["latency_profile"] = str(DEFAULT_LATENCY_PROFILE)
    config = parse_config(
        {
            "model": model_dir,
            "dtype": "float64",
            **LAYOUTS[mode],
            "kv_cache": {"num_blocks": 512, "block_size": 16},
            "kv_transfer": {"transfer_timeout_s": KV_DEADLINE_S, "start_timeout_s": KV_DEADLINE_S},
            "router": router,
            "ray": {"enabled": runtime == "ray"},
        }
    )
    return build_cluster_spec(config)


def open_runtime(spec: ClusterSpec) -> ServingCluster:
    if not spec.ray.enabled:
        return LocalCluster(spec)
    from deploy.runtime.ray.cluster import RayCluster  # imports ray: only when asked for

    return RayCluster(spec)


def prompts(num: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 96))] for _ in range(num)]


def reference(address: str, prompt_set: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from the cluster before any fault."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return [
            list(
                stub.GenerateUnary(
                    pb.GenerateRequest(token_ids=p, max_tokens=max_tokens, ignore_eos=True),
                    timeout=120,
                ).token_ids
            )
            for p in prompt_set
        ]


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def leaked_blocks(cluster: ServingCluster, settle_s: float = 30.0) -> int:
    """KV blocks in use on every worker, once they stop changing (bounded wait)."""
    deadline = time.monotonic() + settle_s
    while True:
        used = sum(load.num_total_blocks - load.num_free_blocks for load in loads(cluster))
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = resolve_model(args.model)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    with open_runtime(cluster_spec(model_dir, args.mode, args.runtime)) as cluster:
        address = cluster.start()
        prompt_set = prompts(args.num_prompts, vocab_size, args.seed)
        expected = reference(address, prompt_set, args.max_tokens)
        rss_start = rss_by_kind(cluster)
        parent, child = mp.get_context("spawn").Pipe(duplex=False)
        load = mp.get_context("spawn").Process(
            target=run_load,
            args=(
                child,
                address,
                prompt_set,
                args.max_tokens,
                args.duration_s,
                args.concurrency,
                args.seed,
            ),
        )
        load.start()
        faults = Faults(cluster, lambda: serving(address), rng, KV_DEADLINE_S)
        kinds = faults_for(cluster)
        began = time.monotonic()
        for index in range(10_000):  # bounded: the load's duration ends it long before
            wait_s = rng.uniform(0.5, 1.5) * args.fault_every_s
            if time.monotonic() - began + wait_s > args.duration_s - 5:
                break
            time.sleep(wait_s)
            faults.inject(kinds[index % len(kinds)])
        records = parent.recv() if parent.poll(args.duration_s + 400) else []
        load.join(30)
        leaked = leaked_blocks(cluster)
        rss_end = rss_by_kind(cluster)
    counts = classify(records, expected)
    return report(counts, faults.log, leaked, rss_start, rss_end, args)


def report(
    counts: dict[str, Any],
    faults: list[dict[str, Any]],
    leaked: int,
    rss_start: dict[str, float],
    rss_end: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    hit = counts["migrated"] + counts["lost_streams"]
    completed = 100.0 * counts["migrated"] / hit if hit else 100.0
    growth = {
        kind: round(100.0 * (rss_end[kind] - rss_start[kind]) / rss_start[kind], 1)
        for kind in rss_start
        if kind in rss_end and rss_start[kind]
    }
    result = {
        **{key: value for key, value in counts.items() if key != "examples"},
        "faults_injected": sum(1 for fault in faults if fault.get("injected")),
        "faults_healed": sum(1 for fault in faults if fault.get("healed")),
        "migration_completed_pct": round(completed, 1),
        "leaked_blocks": leaked,
        "rss_growth_pct": growth,
        "runtime": args.runtime,
        "mode": args.mode,
        "duration_s": args.duration_s,
        "concurrency": args.concurrency,
        "faults": faults,
        "examples": counts["examples"],
    }
    targets = (
        ("failed_before_first_token", 0),
        ("lost_streams", 0),
        ("repeated_or_skipped_tokens", 0),
        ("leaked_blocks", 0),
        ("hangs", 0),
    )
    result["ok"] = (
        all(result[key] == value for key, value in targets)
        and completed >= 95.0
        and result["faults_healed"] == result["faults_injected"] > 0
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
