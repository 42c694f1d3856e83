"""How fast the router streams, and how much latency it adds per token, against bare gRPC.

    python -m benchmarks.router_load [--clients 64] [--tokens 256] [--rounds 3] [--out PATH]

Two servers stream the same synthetic tokens to the same clients, one after the other in this
run:

  router    the real Router (validation, admission, dispatch policies, the worker pool's
            demultiplexer, incremental detokenizing, stop strings, metrics, protobuf, gRPC);
  baseline  a bare gRPC servicer that hands each request to a worker and writes every event
            as a GenerateResponse with its token ids: gRPC's own floor on this machine.

The workers are synthetic colocated instances (router/synthetic.py: the real handle interface,
tokens on a fixed clock, no model) in the server's process, so what is measured is the server.
Each instance emits one token for each of its streams per step, all at once, like a decode step;
the instances' clocks differ by 2% each, so over a round their bursts drift through every
alignment instead of keeping whatever phase the start gave them.

The clients are asyncio gRPC streams in a separate (spawned) process. With two or more cores the
server is pinned to the first and the clients to the second (--no-pin to turn it off), as a
client on another machine would be.

Per token, added latency = the time the client received it - the time the worker produced it
(both time.time() on this machine). `tokens_per_s` = tokens received by all clients / wall time
of a measured round (their mean). Percentiles pool every token of every measured round. Prints
one JSON object as the last line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from pdserve_proto.v1 import generation_pb2 as pb

from engine.gc_tuning import freeze_startup_heap, unfreeze_heap
from engine.sampling_params import SamplingParams
from planner.metrics import percentile
from router.config import RouterConfig
from router.server import Router
from router.servicer import SERVICE_NAME
from router.synthetic import SyntheticWorker
from router.worker_api import Role, TokenEvent, WorkerRequest

_CLOCK_SPREAD = 0.02  # instance i steps every step_interval_s * (1 + 0.02 i)


def _client_process(
    address: str,
    num_clients: int,
    num_tokens: int,
    rounds: list[str],
    core: int | None,
    out: mp.Queue,
) -> None:
    """Run each round of `num_clients` concurrent streams; send back every token's receive time."""
    if core is not None:
        os.sched_setaffinity(0, {core})
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


class _BareStreamer:
    """The baseline: Generate hands the request to a worker (round robin) and writes each of
    its events as it comes; no validation, tokenizer, policies, detokenizing or metrics."""

    def __init__(self, workers: Sequence[SyntheticWorker]) -> None:
        self._workers = list(workers)
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._num_started = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._poll(w)) for w in self._workers]
        server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(
            self._generate,
            request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(1.0)

    async def _poll(self, worker: SyntheticWorker) -> None:
        while True:
            for event in await worker.poll_events(1.0):
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        queue = self._queues[request.request_id] = asyncio.Queue()
        worker = self._workers[self._num_started % len(self._workers)]
        self._num_started += 1
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        try:
            await worker.submit(WorkerRequest(request.request_id, [1], params, time.time()), None)
            while True:
                event = await queue.get()
                yield pb.GenerateResponse(request_id=event.request_id, token_ids=event.token_ids)
                if event.finish_reason is not None:
                    return
        finally:
            del self._queues[request.request_id]


def _workers(args: argparse.Namespace) -> list[SyntheticWorker]:
    return [
        SyntheticWorker(
            f"colocated-{i}",
            Role.COLOCATED,
            num_blocks=4096,
            step_interval_s=args.step_interval_s * (1 + _CLOCK_SPREAD * i),
            prefill_delay_s=0.001,
            record_emit_times=True,
        )
        for i in range(args.instances)
    ]


async def _measure(kind: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    workers = _workers(args)
    server: Any
    if kind == "router":
        server = Router(RouterConfig(model_dir=model_dir, max_running_requests=1024), workers)
    else:
        server = _BareStreamer(workers)
    await server.start()
    freeze_startup_heap()  # as every pdserve server process does once it has started
    rounds = ["warmup", *(f"round{i}" for i in range(args.rounds))]
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    client = context.Process(
        target=_client_process,
        args=(server.address, args.clients, args.tokens, rounds, args.client_core, results),
    )
    client.start()
    measured: list[dict] = []
    try:
        for _ in rounds:
            name, outcome = await asyncio.to_thread(results.get, True, 300)
            if name != "warmup":
                measured.append(outcome)
    finally:
        await asyncio.to_thread(client.join, 30)
        if client.is_alive():
            client.kill()
        await (server.stop(grace_s=1.0) if kind == "router" else server.stop())
        for worker in workers:
            await worker.close()
        unfreeze_heap()
    emit_times: dict[str, list[float]] = {}
    for worker in workers:
        emit_times.update(worker.emit_times)
    return summarize(measured, emit_times, args.tokens)


def summarize(measured: list[dict], emit_times: dict[str, list[float]], num_tokens: int) -> dict:
    """Tokens/s and the latency each token gained between its worker and the client (ms)."""
    added_ms: list[float] = []
    rates: list[float] = []
    for outcome in measured:
        for request_id, received in outcome["received"].items():
            produced = emit_times[request_id]
            assert len(produced) == len(received) == num_tokens, request_id
            added_ms += [(r - p) * 1000.0 for r, p in zip(received, produced, strict=True)]
        num_received = sum(len(r) for r in outcome["received"].values())
        rates.append(num_received / (outcome["ended"] - outcome["started"]))
    return {
        "tokens_per_s": round(sum(rates) / len(rates), 1),
        "p50_ms": round(percentile(added_ms, 50), 3),
        "p90_ms": round(percentile(added_ms, 90), 3),
        "p99_ms": round(percentile(added_ms, 99), 3),
        "max_ms": round(max(added_ms), 3),
    }


async def _bench(args: argparse.Namespace, model_dir: str) -> dict:
    baseline = await _measure("baseline", args, model_dir)
    router = await _measure("router", args, model_dir)
    mean_interval_s = args.step_interval_s * (1 + _CLOCK_SPREAD * (args.instances - 1) / 2)
    return {
        "benchmark": "router",
        "clients": args.clients,
        "tokens_per_client": args.tokens,
        "measured_rounds": args.rounds,
        "worker_instances": args.instances,
        "pinned": {"server_core": args.server_core, "client_core": args.client_core},
        "offered_tokens_per_s": round(args.clients / mean_interval_s, 1),
        "tokens_per_s": router["tokens_per_s"],
        "p50_added_ms": router["p50_ms"],
        "p99_added_ms": router["p99_ms"],
        "max_added_ms": router["max_ms"],
        "router": router,
        "baseline_bare_grpc": baseline,
        "p99_over_baseline_ms": round(router["p99_ms"] - baseline["p99_ms"], 3),
        "p99_ratio_to_baseline": round(router["p99_ms"] / baseline["p99_ms"], 3),
        "tokens_per_s_ratio_to_baseline": round(
            router["tokens_per_s"] / baseline["tokens_per_s"], 3
        ),
        "targets": {"tokens_per_s": ">= 5000", "p99_added_ms": "<= 5"},
    }


def _default_model_dir() -> str:
    """A folder with the tiny test tokenizer and a config.json: all the router reads."""
    from transformers import LlamaConfig

    from tests.router.tiny_tokenizer import add_tiny_tokenizer

    model_dir = tempfile.mkdtemp(prefix="pdserve-router-bench-")
    LlamaConfig(vocab_size=512, max_position_embeddings=4096).save_pretrained(model_dir)
    return add_tiny_tokenizer(model_dir)


def run_cli(description: str, bench: Any, argv: list[str] | None = None) -> int:
    """The command line both front-door benchmarks share (this one and benchmarks/http_front.py):
    parse, pin the server and the clients to a core each, run `bench(args, model_dir)`, print
    the result as one JSON line (and write it to --out)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per client stream")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side")
    parser.add_argument("--instances", type=int, default=4, help="synthetic worker instances")
    parser.add_argument("--step-interval-s", type=float, default=0.008, help="per-stream token gap")
    parser.add_argument("--model-dir", help="folder with the tokenizer (default: the tiny one)")
    parser.add_argument("--no-pin", action="store_true", help="leave processes unpinned")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    args.server_core = args.client_core = None
    if not args.no_pin and len(cores) >= 2:
        args.server_core, args.client_core = cores[0], cores[1]
        os.sched_setaffinity(0, {args.server_core})
    result = asyncio.run(bench(args, args.model_dir or _default_model_dir()))
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__.splitlines()[0], _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
