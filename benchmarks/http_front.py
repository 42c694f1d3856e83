"""The OpenAI-compatible HTTP front door against the gRPC one, in one run, over the same workers.

    python -m benchmarks.http_front [--clients 64] [--tokens 256] [--rounds 3] [--out PATH]

One Router serves both APIs (router/http_api beside gRPC) over synthetic colocated workers
(router/synthetic.py: the real handle interface, tokens on a fixed clock, no model), set up as in
benchmarks/router_load.py, whose pieces this reuses. The same clients first stream over gRPC
(`Generate`), then over HTTP (`POST /v1/completions` with `stream: true`, server-sent events):
a warm-up round and `--rounds` measured rounds each, `--clients` concurrent streams of
`--tokens` tokens per round.

The HTTP clients are a bare asyncio HTTP/1.1 reader in a spawned process, so what is measured is
the server, not an SDK's parsing. They ask for `stream_options.continuous_usage_stats` (usage on
every chunk) to count the tokens each event carries, and name each request (`request_id`) so
its tokens can be matched with the times the worker produced them.

Per token, added latency = the time the client received it - the time the worker produced it
(both time.time() on this machine). tokens/s = tokens received by all clients / wall time of a
measured round (their mean). With two or more cores the server is pinned to the first and the
clients to the second (--no-pin to turn it off). Prints one JSON object as the last line (and
writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import sys
import time
from typing import Any

from benchmarks.router_load import (
    _CLOCK_SPREAD,
    _client_process,
    _workers,
    run_cli,
    summarize,
)
from engine.gc_tuning import freeze_startup_heap, unfreeze_heap
from router.config import RouterConfig
from router.server import Router

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
TARGET_RATIO = 0.8


async def _http_stream(
    port: int, model: str, request_id: str, num_tokens: int
) -> tuple[str, list[float]]:
    """One streamed completion; every token's receive time."""
    body = json.dumps(
        {
            "model": model,
            "prompt": f"client {request_id}",
            "max_tokens": num_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "request_id": request_id,
            "stream_options": {"continuous_usage_stats": True},
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{request_id}: {status!r}")
    while await reader.readline() not in (b"\r\n", b""):
        pass  # headers
    received: list[float] = []
    # Chunked framing puts size lines between the events: only `data:` lines count.
    while line := await reader.readline():
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            break
        match = _COMPLETION_TOKENS.search(line)
        if match is not None:
            now = time.time()
            received += [now] * (int(match.group(1)) - len(received))
    writer.close()
    return request_id, received


def _http_client_process(
    port: int,
    model: str,
    num_clients: int,
    num_tokens: int,
    rounds: list[str],
    core: int | None,
    out: mp.Queue,
) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})

    async def run_round(name: str) -> dict:
        started = time.time()
        results = await asyncio.gather(
            *(_http_stream(port, model, f"{name}-{i}", num_tokens) for i in range(num_clients))
        )
        return {"started": started, "ended": time.time(), "received": dict(results)}

    for name in rounds:
        out.put((name, asyncio.run(run_round(name))))


async def _run_clients(kind: str, router: Router, args: argparse.Namespace) -> list[dict]:
    rounds = [f"{kind}-warmup", *(f"{kind}-round{i}" for i in range(args.rounds))]
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    if kind == "grpc":
        target: Any = _client_process
        head: tuple[Any, ...] = (router.address,)
    else:
        target, head = _http_client_process, (router.http_port, router.config.model_name)
    client = context.Process(
        target=target, args=(*head, args.clients, args.tokens, rounds, args.client_core, results)
    )
    client.start()
    measured: list[dict] = []
    try:
        for _ in rounds:
            name, outcome = await asyncio.to_thread(results.get, True, 300)
            if not name.endswith("warmup"):
                measured.append(outcome)
    finally:
        await asyncio.to_thread(client.join, 30)
        if client.is_alive():
            client.kill()
    return measured


async def _bench(args: argparse.Namespace, model_dir: str) -> dict:
    workers = _workers(args)
    config = RouterConfig(model_dir=model_dir, max_running_requests=1024, http_port=0)
    router = Router(config, workers)
    await router.start()
    freeze_startup_heap()  # as every pdserve server process does once it has started
    try:
        measured = {kind: await _run_clients(kind, router, args) for kind in ("grpc", "http")}
    finally:
        await router.stop(grace_s=1.0)
        for worker in workers:
            await worker.close()
        unfreeze_heap()
    emit_times: dict[str, list[float]] = {}
    for worker in workers:
        emit_times.update(worker.emit_times)
    grpc_ = summarize(measured["grpc"], emit_times, args.tokens)
    http = summarize(measured["http"], emit_times, args.tokens)
    mean_interval_s = args.step_interval_s * (1 + _CLOCK_SPREAD * (args.instances - 1) / 2)
    ratio = http["tokens_per_s"] / grpc_["tokens_per_s"]
    return {
        "benchmark": "http_front",
        "clients": args.clients,
        "tokens_per_client": args.tokens,
        "measured_rounds": args.rounds,
        "worker_instances": args.instances,
        "pinned": {"server_core": args.server_core, "client_core": args.client_core},
        "offered_tokens_per_s": round(args.clients / mean_interval_s, 1),
        "http": http,
        "grpc": grpc_,
        "http_tokens_per_s": http["tokens_per_s"],
        "grpc_tokens_per_s": grpc_["tokens_per_s"],
        "http_to_grpc_tokens_per_s_ratio": round(ratio, 3),
        "http_p99_added_ms": http["p99_ms"],
        "grpc_p99_added_ms": grpc_["p99_ms"],
        "http_p99_added_ms_over_grpc": round(http["p99_ms"] - grpc_["p99_ms"], 3),
        "target": f"http_tokens_per_s >= {TARGET_RATIO} x grpc_tokens_per_s",
        "meets_target": ratio >= TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__.splitlines()[0], _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
