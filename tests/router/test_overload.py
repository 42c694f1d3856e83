"""A burst of calls far past admission's bounds: every refused call gets RESOURCE_EXHAUSTED with
a message, none a bare CANCELLED from gRPC core (which drops calls at random once more than
1,000 wait to be accepted)."""

from __future__ import annotations

import asyncio
import collections

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.server import max_pending_calls
from router.synthetic import synthetic_cluster
from tests.router.harness import RouterThread

NUM_CALLS = 2000  # well past gRPC core's 1,000 pending calls


async def _burst(address: str, num_calls: int) -> collections.Counter[tuple[str, str]]:
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one() -> None:
            request = pb.GenerateRequest(prompt="hi", max_tokens=8)
            try:
                async for _ in stub.Generate(request, timeout=60):
                    pass
                outcomes["OK", ""] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name, (exc.details() or "")[:30]] += 1

        await asyncio.gather(*(one() for _ in range(num_calls)))
    return outcomes


def test_a_burst_past_the_bounds_is_refused_with_resource_exhausted_never_cancelled(
    tiny_model_dir: str,
) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, max_running_requests=4, max_queued_requests=4)
    assert max_pending_calls(config) >= NUM_CALLS  # the whole burst may wait in gRPC core
    make_handles = lambda: synthetic_cluster(1, 1, step_interval_s=0.05)  # noqa: E731
    with RouterThread(config, make_handles) as server:
        outcomes = asyncio.run(asyncio.wait_for(_burst(server.address, NUM_CALLS), 120))
    codes = collections.Counter()
    for (code, _detail), count in outcomes.items():
        codes[code] += count
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert codes["OK"] >= 8 and codes["RESOURCE_EXHAUSTED"] > 0, outcomes
    assert (
        outcomes["RESOURCE_EXHAUSTED", "the router is at capacity (4 r"]
        == codes["RESOURCE_EXHAUSTED"]
    )


def test_the_calls_grpc_core_may_hold_are_bounded_by_admission_s_size(tiny_model_dir: str) -> None:
    """A flood may not park a million calls (up to 4 MB each) in gRPC core: a few times what
    admission holds, and never below gRPC core's own default."""
    small = RouterConfig(model_dir=tiny_model_dir, max_running_requests=4, max_queued_requests=4)
    large = RouterConfig(
        model_dir=tiny_model_dir, max_running_requests=1000, max_queued_requests=500
    )
    assert (max_pending_calls(small), max_pending_calls(large)) == (2048, 6000)
