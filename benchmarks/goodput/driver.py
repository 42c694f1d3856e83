"""Drive a workload against a router from several client processes or Ray tasks, and merge.

    with LoadDriver(num_processes=2) as driver:               # or ray_address="auto"
        records = driver.run(address, requests)               # every RequestRecord, merged

Request i goes to shard i % num_shards (round robin keeps each shard's arrivals a thinned copy of
the same process). All shards are given one start time on the wall clock, `lead_s` ahead, and
each converts it to its own monotonic clock (client.WallClock), so a shard that starts late only
skips its sleep; records carry their shard index.

With num_processes=0 the single shard runs in this process (tests; a router in this process would
share its GIL with the clients, so benchmarks use >= 1 process). With `ray_address`, shards are
Ray tasks spread over the cluster's nodes (SPREAD), one per node by default.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

from benchmarks.goodput.client import run_shard
from benchmarks.goodput.workloads import BenchRequest
from planner.metrics import RequestRecord


def _warm_up(_: object = None) -> int:
    """Import the client's modules in a pool process before the clock starts."""
    import os

    import grpc  # noqa: F401
    from pdserve_proto.v1 import generation_pb2_grpc  # noqa: F401

    return os.getpid()


class LoadDriver:
    """Client shards that outlive one run, so a sweep pays their start-up once."""

    def __init__(
        self,
        num_processes: int = 1,
        ray_address: str | None = None,
        num_ray_shards: int = 0,
        lead_s: float = 0.5,
        request_timeout_s: float = 300.0,
    ) -> None:
        if num_processes < 0:
            raise ValueError(f"num_processes must be >= 0, got {num_processes}")
        self.num_processes = num_processes
        self.ray_address = ray_address
        self.num_ray_shards = num_ray_shards
        self.lead_s = lead_s
        self.request_timeout_s = request_timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self.last_clocks: list[dict[str, Any]] = []
        if ray_address is None and num_processes > 0:
            self._pool = ProcessPoolExecutor(num_processes, mp_context=mp.get_context("spawn"))
            list(self._pool.map(_warm_up, [None] * num_processes, timeout=120))

    @property
    def num_shards(self) -> int:
        if self.ray_address is not None:
            return self.num_ray_shards or _ray_num_nodes(self.ray_address)
        return max(1, self.num_processes)

    def run(self, address: str, requests: list[BenchRequest]) -> list[RequestRecord]:
        """Send every request on schedule; records in request order."""
        num_shards = self.num_shards
        shards = [requests[i::num_shards] for i in range(num_shards)]
        start_wall_time = time.time() + self.lead_s
        args = [
            (address, shard, start_wall_time, i, self.request_timeout_s)
            for i, shard in enumerate(shards)
            if shard
        ]
        if self.ray_address is not None:
            results = _run_on_ray(self.ray_address, args)
        elif self._pool is None:
            results = [run_shard(*arg) for arg in args]
        else:
            futures = [self._pool.submit(run_shard, *arg) for arg in args]
            results = _results(futures)
        # Each shard's host, pid and clock anchors: how its monotonic times map to wall time.
        self.last_clocks = [result["clock"] for result in results]
        by_id = {
            r["request_id"]: RequestRecord.from_json(r)
            for result in results
            for r in result["records"]
        }
        records = [by_id[request.request_id] for request in requests]
        for record, request in zip(records, requests, strict=True):
            record.slo_class = request.slo_class
        return records

    def close(self, abandon: bool = False) -> None:
        """Stop the client processes; `abandon` kills shards still sending (an interrupted run)."""
        if self._pool is None:
            return
        if abandon:
            # ProcessPoolExecutor cannot cancel a running task: end its processes ourselves.
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=not abandon, cancel_futures=True)
        self._pool = None

    def __enter__(self) -> LoadDriver:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.close(abandon=exc_type is not None)


def _results(futures: list[Future[Any]]) -> list[Any]:
    """Wait in short slices: a Ctrl-C may land on another thread, and the main thread only
    sees it when it wakes up."""
    while True:
        _, pending = wait(futures, timeout=0.5)
        if not pending:
            return [future.result() for future in futures]


def _ray_num_nodes(ray_address: str) -> int:
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))


def _run_on_ray(ray_address: str, args: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """One Ray task per shard, spread over the nodes; the router address must be reachable
    from every node (start the router with host 0.0.0.0 or the head's IP)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    remote_shard = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(run_shard)
    return ray.get([remote_shard.remote(*arg) for arg in args])
