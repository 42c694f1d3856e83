"""A worker that stops answering: its in-flight requests end with UNAVAILABLE, health turns
NOT_SERVING, and both recover when the worker reports healthy again."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.synthetic import SyntheticWorker
from router.worker_api import InstanceLoad, Role, TokenEvent, WorkerUnavailable
from tests.router.harness import RouterThread


class DyingWorker(SyntheticWorker):
    """A synthetic worker whose calls raise WorkerUnavailable while `dead` is set."""

    dead = False

    async def load(self) -> InstanceLoad:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} is dead")
        return await super().load()

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} is dead")
        return await super().poll_events(timeout_s)


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _wait_for_health(channel: grpc.Channel, status: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(channel) != status and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _health(channel) == status


def test_dead_worker_fails_its_requests_with_unavailable_and_recovers(tiny_model_dir: str) -> None:
    worker = DyingWorker("colocated-0", Role.COLOCATED, step_interval_s=0.02)
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.02)
    with RouterThread(config, lambda: ([worker], [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=200), timeout=20)
            next(call)
            worker.dead = True
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "colocated-0 became unavailable" in error.value.details()
            _wait_for_health(channel, health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(grpc.RpcError) as error:
                stub.GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            worker.dead = False  # "restarted"
            _wait_for_health(channel, health_pb2.HealthCheckResponse.SERVING)
            reply = stub.GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=5)
            assert len(reply.token_ids) == 2
