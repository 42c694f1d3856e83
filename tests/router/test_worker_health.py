"""Worker health in the metrics tells the truth: a dead worker shows as down and holding nothing
at once, and up again after its restart; a worker that hangs delays only its own reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import SyntheticWorker
from router.worker_api import InstanceLoad, Role, TokenEvent, WorkerUnavailable
from tests.router.harness import RouterThread

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FlakyWorker(SyntheticWorker):
    """`dead`: every call fails at once (a dead process). `hung`: load reports never come."""

    dead = False
    hung = False

    async def load(self, prefix: object = None) -> InstanceLoad:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        while self.hung:
            await asyncio.sleep(0.01)
        return await super().load()

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        return await super().poll_events(timeout_s)


def _gauge(server: RouterThread, name: str, instance_id: str) -> float | None:
    assert server.router is not None
    labels = {"instance": instance_id, "role": "colocated"}
    return server.router.metrics.registry.get_sample_value(f"pdserve:{name}", labels)


def _within(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `condition()` held; fails after timeout_s."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s}s"
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_dead_worker_shows_down_and_empty_at_once_then_up_after_its_restart(
    tiny_model_dir: str,
) -> None:
    worker = FlakyWorker("colocated-0", Role.COLOCATED, step_interval_s=0.02)
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.05)
    with RouterThread(config, lambda: ([worker], [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=300), timeout=20)
            next(call)
            _within(lambda: _gauge(server, "worker_num_requests_running", "colocated-0") == 1, 2)
            assert _gauge(server, "kv_blocks_used", "colocated-0") == 1  # the prompt's block
            worker.dead = True
            _within(lambda: _gauge(server, "worker_healthy", "colocated-0") == 0, 2)
            assert _gauge(server, "worker_num_requests_running", "colocated-0") == 0
            assert _gauge(server, "kv_blocks_used", "colocated-0") == 0
            assert _gauge(server, "kv_blocks_total", "colocated-0") == 256
            call.cancel()
            worker.dead = False  # "restarted"
            _within(lambda: _gauge(server, "worker_healthy", "colocated-0") == 1, 2)


def test_a_hung_worker_delays_only_its_own_load_reports(tiny_model_dir: str) -> None:
    workers = [
        FlakyWorker(f"colocated-{i}", Role.COLOCATED, step_interval_s=0.02) for i in range(2)
    ]
    config = RouterConfig(
        model_dir=tiny_model_dir,
        prefill_policy="round_robin",  # the first request goes to colocated-0
        load_refresh_interval_s=0.05,
        worker_timeout_s=5.0,
    )
    with RouterThread(config, lambda: (workers, [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=25), timeout=20)
            next(call)
            _within(lambda: _gauge(server, "worker_num_requests_running", "colocated-0") == 1, 2)
            workers[1].hung = True
            time.sleep(0.2)  # its next load report is now stuck
            assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
            # colocated-0's report still comes on time (not after colocated-1's 5 s timeout).
            _within(lambda: _gauge(server, "worker_num_requests_running", "colocated-0") == 0, 2)
            _within(lambda: _gauge(server, "worker_healthy", "colocated-1") == 0, 8)
            workers[1].hung = False
            _within(lambda: _gauge(server, "worker_healthy", "colocated-1") == 1, 2)


def test_health_follows_a_lost_prefill_instance_back_to_serving(tiny_model_dir: str) -> None:
    decode = SyntheticWorker("decode-0", Role.DECODE)
    prefill = FlakyWorker("prefill-0", Role.PREFILL, peers={"decode-0": decode})
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.05)
    with RouterThread(config, lambda: ([prefill], [decode])) as server:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

            for dead, expected in ((True, _NOT_SERVING), (False, _SERVING)) * 2:
                prefill.dead = dead
                _within(lambda e=expected: status() == e, 3)
            stub = pb_grpc.GenerationStub(channel)
            reply = stub.GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=3), timeout=10)
            assert len(reply.token_ids) == 3
