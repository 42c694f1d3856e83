"""One shard of the load: asyncio gRPC streaming clients sending requests on schedule.

Each request is a `Generate` server stream with `token_ids` (no tokenizer effects), `max_tokens`
= its target, `ignore_eos`, and its class's SLOs (`ttft_slo_s`, `tpot_slo_s`: an adaptive cluster
places it by them; fixed layouts ignore them). The client notes the send time, the arrival time
of every token (a message carrying n tokens gives all n the same time) and the finish, on this
process's monotonic clock mapped to wall-clock time once at start (`WallClock`): several
processes or nodes then share one timeline (up to their wall clocks' agreement), while each
latency is a difference of two readings of one monotonic clock. From the last response it keeps
where the request ran and, from an adaptive cluster, how it was placed (RequestRecord).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from benchmarks.goodput.workloads import BenchRequest
from planner.metrics import RequestRecord

TIMING_FIELDS = (
    "router_queue_s",
    "prefill_queue_s",
    "prefill_s",
    "kv_transfer_s",
    "decode_queue_s",
    "first_token_s",
    "per_token_s",
    "e2e_s",
)
_FINISH_REASONS = {0: "", 1: "stop", 2: "length", 3: "abort", 4: "error"}


class WallClock:
    """time.time() read once, time.perf_counter() after: monotonic, in the wall-clock frame."""

    def __init__(self) -> None:
        self.wall_anchor = time.time()
        self.monotonic_anchor = time.perf_counter()

    def now(self) -> float:
        return self.wall_anchor + (time.perf_counter() - self.monotonic_anchor)


# (address, requests, start_wall_time, shard, request_timeout_s, clock) -> the shard's records:
# run_shard_async here, or http_client's run_http_shard_async for an OpenAI-compatible server.
ShardRunner = Callable[
    [str, list[BenchRequest], float, int, float, WallClock],
    Coroutine[Any, Any, list[RequestRecord]],
]


def _record_placement(record: RequestRecord, last: Any) -> None:
    """Where the last response says the request ran, and how an adaptive cluster placed it."""
    record.prefill_instance = last.prefill_instance
    record.decode_instance = last.decode_instance
    if last.HasField("placement") and last.placement.kind:  # a fixed layout leaves it unset
        placement = last.placement
        record.placement_kind = placement.kind
        record.predicted_ttft_s = placement.predicted_ttft_s
        record.predicted_tpot_s = placement.predicted_tpot_s
        record.prefill_role_instances = placement.prefill_role_instances


async def _one_request(
    stub: Any, request: BenchRequest, clock: WallClock, shard: int, timeout_s: float
) -> RequestRecord:
    from pdserve_proto.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(
        token_ids=list(request.prompt_token_ids),
        max_tokens=request.output_len,
        ignore_eos=True,
        request_id=request.request_id,
        ttft_slo_s=request.ttft_slo_s,
        tpot_slo_s=request.tpot_slo_s,  # None leaves them unset
    )
    record = RequestRecord(
        request.request_id,
        len(request.prompt_token_ids),
        request.output_len,
        clock.now(),
        shard=shard,
    )
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            now = clock.now()
            record.token_times.extend([now] * len(response.token_ids))
            if response.finish_reason:
                record.finish_reason = _FINISH_REASONS.get(response.finish_reason, "?")
                record.timings = {f: getattr(response.timings, f) for f in TIMING_FIELDS}
                _record_placement(record, response)
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    if not record.error and not record.finish_reason:
        record.error = "the stream ended without a finish_reason"
    return record


async def run_shard_async(
    address: str,
    requests: list[BenchRequest],
    start_wall_time: float,
    shard: int = 0,
    request_timeout_s: float = 300.0,
    clock: WallClock | None = None,
) -> list[RequestRecord]:
    """Send each request at start_wall_time + its offset; every record, in request order."""
    from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

    clock = clock or WallClock()
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        for request in sorted(requests, key=lambda r: r.send_offset_s):
            delay = start_wall_time + request.send_offset_s - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(_one_request(stub, request, clock, shard, request_timeout_s))
            )
        records = await asyncio.gather(*tasks)
    by_id = {record.request_id: record for record in records}
    return [by_id[request.request_id] for request in requests]


def run_shard(
    address: str,
    requests: list[BenchRequest],
    start_wall_time: float,
    shard: int = 0,
    request_timeout_s: float = 300.0,
) -> dict[str, Any]:
    """`run_shard_async` (or, for an http:// address, http_client's) in a fresh event loop, as JSON (picklable anywhere: a spawned process
    or a Ray task): {"records": [...], "clock": this process's host, pid and clock anchors}."""
    clock = WallClock()
    run: ShardRunner
    if address.startswith(("http://", "https://")):  # any OpenAI-compatible server
        from benchmarks.goodput.http_client import run_http_shard_async

        run = run_http_shard_async
    else:
        run = run_shard_async
    records = asyncio.run(run(address, requests, start_wall_time, shard, request_timeout_s, clock))
    return {
        "records": [record.to_json() for record in records],
        "clock": {
            "shard": shard,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "wall_anchor": clock.wall_anchor,
            "monotonic_anchor": clock.monotonic_anchor,
        },
    }
