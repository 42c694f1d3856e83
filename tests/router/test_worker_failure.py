"""A worker that stops answering: its in-flight requests end with UNAVAILABLE, health turns
NOT_SERVING, and both recover when the worker reports healthy again."""

from __future__ import annotations

import asyncio
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

    async def load(self, prefix: object = None) -> InstanceLoad:
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
    """With recovery off, a lost worker's stream ends with UNAVAILABLE at once."""
    worker = DyingWorker("colocated-0", Role.COLOCATED, step_interval_s=0.02)
    config = RouterConfig(
        model_dir=tiny_model_dir, load_refresh_interval_s=0.02, max_retries=0, recovery_wait_s=0
    )
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


class HandOffFailingPrefill(SyntheticWorker):
    """Emits the first token, then fails the request the way a prefill Worker does when a KV
    hand-off breaks (`failed_peer` names the decode instance), or with a plain error."""

    failed_peer = "decode-0"

    async def _prefill(self, request, ticket) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.prefill_delay_s)
        self._events.append(TokenEvent(request.request_id, [5], source=self.instance_id))
        error = TokenEvent(
            request.request_id, [], "error", "handing the KV off failed", self.instance_id
        )
        error.failed_peer = self.failed_peer
        self._events.append(error)
        await self.abort(request.request_id)
        self._wakeup.set()


@pytest.mark.parametrize(
    ("failed_peer", "code", "detail"),
    [
        ("decode-0", grpc.StatusCode.UNAVAILABLE, "worker decode-0 became unavailable"),
        ("", grpc.StatusCode.INTERNAL, "worker prefill-0 failed the request"),
    ],
)
def test_a_broken_kv_hand_off_is_unavailable_and_other_worker_errors_internal(
    tiny_model_dir: str, failed_peer: str, code: grpc.StatusCode, detail: str
) -> None:
    decode = SyntheticWorker("decode-0", Role.DECODE)
    prefill = HandOffFailingPrefill("prefill-0", Role.PREFILL, peers={"decode-0": decode})
    prefill.failed_peer = failed_peer
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.02, max_retries=0)
    with RouterThread(config, lambda: ([prefill], [decode])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=20), timeout=10))
            assert error.value.code() == code
            assert detail in error.value.details()
        loads = server.loads()
    assert all(load.num_free_blocks == load.num_total_blocks for load in loads)
