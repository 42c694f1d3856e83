"""Bursts of calls far past admission's bounds: every refused call gets RESOURCE_EXHAUSTED with
a message, none a bare CANCELLED from gRPC core (which drops calls at random once more than
1,000 wait to be accepted); the router's memory stays bounded, and afterwards it holds nothing."""

from __future__ import annotations

import asyncio
import collections
import gc
import time

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.server import max_pending_calls
from router.synthetic import synthetic_cluster
from router.worker_api import InstanceLoad
from tests.router.harness import RouterThread

NUM_CALLS = 2000  # well past gRPC core's 1,000 pending calls
MAX_RSS_GROWTH_MB = 100  # over 1,600 calls: a leak of even 64 kB per call would pass it


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


def _rss_mb() -> float:
    """This process's resident memory: the router, its synthetic workers and the clients."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_ten_times_capacity_is_refused_cleanly_memory_stays_bounded_and_pools_recover(
    tiny_model_dir: str,
) -> None:
    config = RouterConfig(model_dir=tiny_model_dir, max_running_requests=8, max_queued_requests=8)
    capacity = config.max_running_requests + config.max_queued_requests
    make_handles = lambda: synthetic_cluster(2, 2, step_interval_s=0.005)  # noqa: E731
    codes: collections.Counter[str] = collections.Counter()
    with RouterThread(config, make_handles) as server:
        start = [(load.instance_id, load.num_total_blocks) for load in server.loads()]
        asyncio.run(_burst(server.address, 10 * capacity))  # warm-up: imports, caches, pools
        gc.collect()
        rss_before = _rss_mb()
        for _wave in range(10):
            outcomes = asyncio.run(asyncio.wait_for(_burst(server.address, 10 * capacity), 60))
            for (code, _detail), count in outcomes.items():
                codes[code] += count
        gc.collect()
        growth_mb = _rss_mb() - rss_before
        loads = _wait_until_idle(server)
        assert server.router is not None
        admission = server.router.admission
        assert (admission.num_running, admission.num_waiting) == (0, 0)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes  # never CANCELLED or INTERNAL
    assert codes["OK"] >= 10 * capacity and codes["RESOURCE_EXHAUSTED"] >= 10 * capacity, codes
    assert growth_mb < MAX_RSS_GROWTH_MB, f"RSS grew {growth_mb:.0f} MB over the bursts"
    assert [(load.instance_id, load.num_free_blocks) for load in loads] == start
    assert all(load.num_running == load.num_waiting_requests == 0 for load in loads), loads


def _wait_until_idle(server: RouterThread) -> list[InstanceLoad]:
    """The workers' loads once every block is back (a finished request's aborts may still be on
    their way), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        loads = server.loads()
        if all(load.num_free_blocks == load.num_total_blocks for load in loads):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.05)
