"""The chaos benchmark's clients: a steady load with cancels and deadlines, in a process of its own.

Each of `concurrency` clients sends one greedy stream after another, each from a fixed prompt
set, until the load ends: 10% are cancelled after a few tokens, 10% carry a short deadline, the
rest a generous one. Every request leaves a record: what came back (tokens, whether a message
carried its finish reason), how it ended (a status code name, or CANCELLED_BY_CLIENT), when,
and the retries and migrations its final timings report. The records go back to the parent
over a pipe when the load ends; the load runs in its own process so that the router's process
(the parent, which hosts the cluster) measures only the router.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

CANCEL_FRACTION = 0.1
SHORT_DEADLINE_FRACTION = 0.1
SHORT_DEADLINE_S = (0.3, 2.0)


@dataclass
class Record:
    prompt_index: int
    started: float  # time.time()
    deadline_s: float
    short_deadline: bool
    cancel_after: int | None  # tokens
    ended: float = 0.0
    code: str = ""
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # a message carried the finish reason
    retries: int = 0
    migrations: int = 0


async def _one(stub: pb_grpc.GenerationStub, record: Record, prompt: list[int], n: int) -> None:
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=n, ignore_eos=True)
    call = stub.Generate(request, timeout=record.deadline_s)
    try:
        async for message in call:
            record.token_ids.extend(message.token_ids)
            if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                record.finished = True
                record.retries = message.timings.retries
                record.migrations = message.timings.migrations
            if record.cancel_after is not None and len(record.token_ids) >= record.cancel_after:
                call.cancel()
                record.code = "CANCELLED_BY_CLIENT"
                break
        record.code = record.code or "OK"
    except asyncio.CancelledError:
        record.code = "CANCELLED_BY_CLIENT"
    except grpc.aio.AioRpcError as error:
        cancelled = error.code() == grpc.StatusCode.CANCELLED and record.cancel_after is not None
        record.code = "CANCELLED_BY_CLIENT" if cancelled else error.code().name
        record.details = str(error.details())[:300]
    record.ended = time.time()


async def _client(
    address: str,
    prompts: list[list[int]],
    max_tokens: int,
    until: float,
    seed: int,
    records: list[Record],
    max_requests: int,
) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while time.monotonic() < until and len(records) < max_requests:
            index = rng.randrange(len(prompts))
            short = rng.random() < SHORT_DEADLINE_FRACTION
            cancel = not short and rng.random() < CANCEL_FRACTION / (1 - SHORT_DEADLINE_FRACTION)
            record = Record(
                index,
                time.time(),
                rng.uniform(*SHORT_DEADLINE_S) if short else 120.0,
                short,
                rng.randint(1, max_tokens // 2) if cancel else None,
            )
            records.append(record)
            await _one(stub, record, prompts[index], max_tokens)


def run_load(
    conn: Connection,
    address: str,
    prompts: list[list[int]],
    max_tokens: int,
    duration_s: float,
    concurrency: int,
    seed: int,
    max_requests: int = 10**9,
) -> None:
    """The child's entry point: run the load for `duration_s` or `max_requests`, whichever
    ends first, send the records, exit."""
    records: list[Record] = []

    async def main() -> None:
        until = time.monotonic() + duration_s
        clients = [
            _client(address, prompts, max_tokens, until, seed * 1000 + i, records, max_requests)
            for i in range(concurrency)
        ]
        # Every request has a deadline of its own, so this ends; the bound is a backstop.
        await asyncio.wait_for(asyncio.gather(*clients), duration_s + 300)

    try:
        asyncio.run(main())
    finally:
        conn.send([asdict(r) for r in records])
        conn.close()


def classify(records: list[dict[str, Any]], reference: list[list[int]]) -> dict[str, Any]:
    """The benchmark's counts from the records (see benchmarks/chaos.py for the definitions)."""
    counts = dict.fromkeys(
        (
            "requests",
            "completed",
            "cancelled_by_client",
            "client_deadline",
            "overloaded",
            "failed_before_first_token",
            "lost_streams",
            "repeated_or_skipped_tokens",
            "hangs",
            "retried",
            "migrated",
        ),
        0,
    )
    examples: list[dict[str, Any]] = []
    for record in records:
        counts["requests"] += 1
        tokens, code = record["token_ids"], record["code"]
        expected = reference[record["prompt_index"]]
        if tokens != expected[: len(tokens)] or (record["finished"] and tokens != expected):
            counts["repeated_or_skipped_tokens"] += 1
            examples.append({"why": "tokens", **_brief(record)})
        if not record["ended"] or record["ended"] - record["started"] > record["deadline_s"] + 10:
            counts["hangs"] += 1  # no status within its deadline (or none at all)
            examples.append({"why": "hang", **_brief(record)})
            continue
        counts["retried"] += record["retries"] > 0
        counts["migrated"] += record["migrations"] > 0
        if code == "OK" and record["finished"]:
            counts["completed"] += 1
        elif code == "CANCELLED_BY_CLIENT":
            counts["cancelled_by_client"] += 1
        elif code == "DEADLINE_EXCEEDED" and record["short_deadline"]:
            counts["client_deadline"] += 1
        elif code == "RESOURCE_EXHAUSTED":
            counts["overloaded"] += 1
        elif not tokens:
            counts["failed_before_first_token"] += 1
            examples.append({"why": "failed before its first token", **_brief(record)})
        else:
            counts["lost_streams"] += 1
            examples.append({"why": "lost after its first token", **_brief(record)})
    return {**counts, "examples": examples[:10]}


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in ("code", "details", "prompt_index")} | {
        "num_tokens": len(record["token_ids"]),
        "at": record["started"],
    }
