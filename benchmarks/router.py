"""How fast the router streams, and how much latency it adds per token.

    python benchmarks/router.py [--clients 64] [--tokens 256] [--out PATH]

The router runs in this process with synthetic colocated workers (router/synthetic.py: real
handle interface, tokens on a fixed clock, no model), so what is measured is the router itself:
polling, demultiplexing, detokenizing, stop-string checks, protobuf and gRPC. The clients are
asyncio gRPC streams in a separate process (spawned), as real clients would be.

Per token, added latency = the time the client received it - the time the worker produced it
(both time.time() on this machine). `tokens_per_s` = tokens received by all clients / wall
time of the measured round. Prints one JSON object as the last line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "proto")]  # run from a bare checkout too

from router.config import RouterConfig  # noqa: E402
from router.server import Router  # noqa: E402
from router.synthetic import synthetic_cluster  # noqa: E402


def _client_process(
    address: str, num_clients: int, num_tokens: int, rounds: list[str], out: mp.Queue
) -> None:
    """Run each round of `num_clients` concurrent streams; send back every token's receive time."""
    import grpc
    from pdserve_proto.v1 import generation_pb2 as pb
    from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

    async def stream(stub: pb_grpc.GenerationStub, request_id: str) -> tuple[str, list[float]]:
        request = pb.GenerateRequest(
            prompt=f"client {request_id}",
            max_tokens=num_tokens,
            ignore_eos=True,
            request_id=request_id,
        )
        received: list[float] = []
        async for response in stub.Generate(request, timeout=120):
            now = time.time()
            received += [now] * len(response.token_ids)
        return request_id, received

    async def run_round(name: str) -> dict:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            started = time.time()
            results = await asyncio.gather(
                *(stream(stub, f"{name}-{i}") for i in range(num_clients))
            )
            return {"started": started, "ended": time.time(), "received": dict(results)}

    for name in rounds:
        out.put((name, asyncio.run(run_round(name))))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _bench(args: argparse.Namespace, model_dir: str) -> dict:
    workers, _ = synthetic_cluster(
        args.instances, 0, step_interval_s=args.step_interval_s, prefill_delay_s=0.001,
        num_blocks=4096, record_emit_times=True,
    )  # fmt: skip
    config = RouterConfig(model_dir=model_dir, max_running_requests=1024)
    router = Router(config, workers)
    await router.start()
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    rounds = ["warmup", "measured"]
    client = context.Process(
        target=_client_process, args=(router.address, args.clients, args.tokens, rounds, results)
    )
    client.start()
    try:
        measured = None
        for _ in rounds:
            name, outcome = await asyncio.to_thread(results.get, True, 300)
            measured = outcome if name == "measured" else measured
    finally:
        await asyncio.to_thread(client.join, 30)
        if client.is_alive():
            client.kill()
        await router.stop(grace_s=1.0)
    assert measured is not None
    emit_times: dict[str, list[float]] = {}
    for worker in workers:
        emit_times.update(worker.emit_times)
    added_ms = []
    for request_id, received in measured["received"].items():
        produced = emit_times[request_id]
        assert len(produced) == len(received) == args.tokens, request_id
        added_ms += [(r - p) * 1000.0 for r, p in zip(received, produced, strict=True)]
    num_tokens = sum(len(r) for r in measured["received"].values())
    wall_s = measured["ended"] - measured["started"]
    offered = args.clients / args.step_interval_s
    return {
        "benchmark": "router",
        "clients": args.clients,
        "tokens_per_client": args.tokens,
        "worker_instances": args.instances,
        "offered_tokens_per_s": round(offered, 1),
        "tokens_per_s": round(num_tokens / wall_s, 1),
        "p50_added_ms": round(_percentile(added_ms, 0.50), 3),
        "p99_added_ms": round(_percentile(added_ms, 0.99), 3),
        "max_added_ms": round(max(added_ms), 3),
        "targets": {"tokens_per_s": ">= 5000", "p99_added_ms": "<= 5"},
    }


def _default_model_dir() -> str:
    """A folder with the tiny test tokenizer and a config.json: all the router reads."""
    from transformers import LlamaConfig

    from tests.router.tiny_tokenizer import add_tiny_tokenizer

    model_dir = tempfile.mkdtemp(prefix="pdserve-router-bench-")
    LlamaConfig(vocab_size=512, max_position_embeddings=4096).save_pretrained(model_dir)
    return add_tiny_tokenizer(model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per client stream")
    parser.add_argument("--instances", type=int, default=4, help="synthetic worker instances")
    parser.add_argument("--step-interval-s", type=float, default=0.008, help="per-stream token gap")
    parser.add_argument("--model-dir", help="folder with the tokenizer (default: the tiny one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = asyncio.run(_bench(args, args.model_dir or _default_model_dir()))
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
