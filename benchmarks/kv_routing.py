"""KV-aware routing: prefix-cache hits on multi-turn chats that share system prompts, the
kv_aware policy against least_tokens and round_robin, on the same cores in one run.

    python -m benchmarks.kv_routing [--conversations 24] [--turns 6] [--quick] [--out FILE]

Workload (seeded): `--system-prompts` system prompts of `--system-len` tokens; conversation i
takes system prompt i mod that many and runs `--turns` turns. A turn sends the whole
conversation so far (system prompt, every user message and every reply as generated) plus a new
user message of 16-48 tokens, and gets a reply of `--reply-len` tokens (ignore_eos).
`--concurrency` conversations run at once, each sending its next turn when its reply is in (a
closed loop), every call with a deadline.

Cluster: `--replicas` colocated replicas of the bench model (benchmarks/goodput/layouts.py; 4 by
default, pinned to the cores in turn: two to a core on this machine, which slows every replica
alike and leaves the hit rates alone) with the prefix cache on and `--num-kv-blocks` blocks per
replica: by default fewer than the conversations' histories need, so one replica cannot hold
them all while the replicas together can. With more replicas, a policy blind to the caches
finds a conversation's history less often. One cluster per policy, started and stopped in turn.

Per policy: the prefix hit rate (cached prompt tokens over prompt tokens, from each response's
usage), TTFT (mean, p50, p90), wall time and requests per instance; and the hit rate the
workload allows at most (every full block before the new user message cached, the system prompt
only after an earlier conversation used it). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from benchmarks.goodput import layouts
from benchmarks.goodput.compare import DEFAULT_MODEL_DIR
from benchmarks.output import emit

POLICIES = ("kv_aware", "least_tokens", "round_robin")
CALL_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt_len: int
    cached: int
    reusable: int  # tokens an ideal cache would hold (full blocks before the new message)
    instance: str
    ttft_s: float
    e2e_s: float


def _user_messages(args: argparse.Namespace, token_range: tuple[int, int]) -> list[list[list[int]]]:
    rng = random.Random(args.seed)
    low, high = token_range
    return [
        [[rng.randrange(low, high) for _ in range(rng.randint(16, 48))] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]


def _system_prompts(args: argparse.Namespace, token_range: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(args.seed + 1)
    return [
        [rng.randrange(*token_range) for _ in range(args.system_len)]
        for _ in range(args.system_prompts)
    ]


def _run_conversation(
    stub: Any, index: int, system: list[int], messages: list[list[int]], args: argparse.Namespace
) -> list[Turn]:
    history = list(system)
    turns = []
    for number, message in enumerate(messages):
        before = len(history)
        prompt = history + message
        request = pb.GenerateRequest(token_ids=prompt, max_tokens=args.reply_len, ignore_eos=True)
        sent = time.perf_counter()
        response = stub.GenerateUnary(request, timeout=CALL_TIMEOUT_S)
        e2e_s = time.perf_counter() - sent
        seen_system = number > 0 or index >= args.system_prompts
        reusable = before - 1 if number > 0 else (len(system) if seen_system else 0)
        turns.append(
            Turn(
                index,
                number,
                len(prompt),
                response.usage.cached_prompt_tokens,
                reusable // args.block_size * args.block_size,
                response.prefill_instance,
                response.timings.first_token_s,
                e2e_s,
            )
        )
        history = prompt + list(response.token_ids)
    return turns


def run_policy(policy: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = layouts.cluster_spec(
        "colocated",
        model_dir,
        pin_cpus=not args.no_pin,
        enable_prefix_caching=True,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
    )
    router = dataclasses.replace(spec.router, prefill_policy=policy)
    spec = dataclasses.replace(spec, router=router, num_colocated_instances=args.replicas)
    token_range = layouts.prompt_token_range(model_dir)
    systems, messages = _system_prompts(args, token_range), _user_messages(args, token_range)
    cluster = layouts.start_local_cluster(spec)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            _warm_up(stub, token_range)
            began = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                futures = [
                    pool.submit(
                        _run_conversation,
                        stub,
                        index,
                        systems[index % len(systems)],
                        messages[index],
                        args,
                    )
                    for index in range(args.conversations)
                ]
                turns = [turn for future in futures for turn in future.result()]
            wall_s = time.perf_counter() - began
    finally:
        cluster.shutdown()
    return _summary(policy, turns, wall_s)


def _warm_up(stub: Any, token_range: tuple[int, int]) -> None:
    """Two short prompts at once (each replica's first steps), none sharing the workload's
    prefixes; their blocks stay cached and count for nothing."""
    rng = random.Random("warm-up")  # not an int: Random(-1) is Random(1), the system prompts
    requests = [
        pb.GenerateRequest(
            token_ids=[rng.randrange(*token_range) for _ in range(24)],
            max_tokens=4,
            ignore_eos=True,
        )
        for _ in range(2)
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: stub.GenerateUnary(r, timeout=CALL_TIMEOUT_S), requests))


def _summary(policy: str, turns: list[Turn], wall_s: float) -> dict[str, Any]:
    prompt_tokens = sum(t.prompt_len for t in turns)
    ttfts = sorted(t.ttft_s for t in turns)
    per_instance: dict[str, int] = {}
    for turn in turns:
        per_instance[turn.instance] = per_instance.get(turn.instance, 0) + 1
    return {
        "policy": policy,
        "requests": len(turns),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(t.cached for t in turns),
        "hit_rate": round(sum(t.cached for t in turns) / prompt_tokens, 4),
        "hit_rate_at_most": round(sum(t.reusable for t in turns) / prompt_tokens, 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
        "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 4),
        "e2e_mean_s": round(statistics.fmean(t.e2e_s for t in turns), 4),
        "wall_s": round(wall_s, 2),
        "requests_per_instance": dict(sorted(per_instance.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--conversations", type=int, default=24)
    add("--turns", type=int, default=6)
    add("--system-prompts", type=int, default=4)
    add("--system-len", type=int, default=256)
    add("--reply-len", type=int, default=24)
    add("--concurrency", type=int, default=8)
    add("--replicas", type=int, default=4, help="colocated replicas (pinned in turn to the cores)")
    add("--num-kv-blocks", type=int, default=256, help="per replica")
    add("--block-size", type=int, default=16)
    add("--policies", default=",".join(POLICIES))
    add("--seed", type=int, default=0)
    add("--model-dir", type=Path, default=None, help=f"default: {DEFAULT_MODEL_DIR}")
    add("--model-size", choices=("bench", "tiny"), default="bench")
    add("--no-pin", action="store_true", help="do not pin each worker to its own core")
    add("--quick", action="store_true", help="8 conversations of 3 turns")
    add("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 8, 3
    model_dir = layouts.ensure_bench_model(args.model_dir or DEFAULT_MODEL_DIR, args.model_size)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, model_dir, args)
        print(results[policy], flush=True)
    summary: dict[str, Any] = {
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "system_prompts": args.system_prompts,
            "system_len": args.system_len,
            "reply_len": args.reply_len,
            "concurrency": args.concurrency,
            "replicas": args.replicas,
            "num_kv_blocks_per_replica": args.num_kv_blocks,
            "block_size": args.block_size,
        },
        "hit_rate": {policy: result["hit_rate"] for policy, result in results.items()},
        "policies": results,
    }
    if "kv_aware" in results:
        best = results["kv_aware"]
        for policy, result in results.items():
            if policy != "kv_aware":
                summary[f"kv_aware_over_{policy}"] = {
                    "hit_rate": round(best["hit_rate"] / max(result["hit_rate"], 1e-9), 3),
                    "ttft_mean": round(best["ttft_mean_s"] / result["ttft_mean_s"], 3),
                    "wall": round(best["wall_s"] / result["wall_s"], 3),
                }
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
