"""Recovery in the router, against synthetic workers that can be "lost" and come back: a stream
whose instance is lost moves on (a retry before its first token, a migration after it), the
client sees one normal stream, and the timings and metrics count what happened. Greedy parity
of migrated streams, on real processes killed for real, is in tests/deploy/test_recovery.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import cast

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from router.config import RouterConfig
from router.generation_errors import FailureKind, GenerationFailed
from router.progress import Progress, is_stale
from router.recovery import Recovery
from router.worker_api import KVTicket, Role, WorkerRequest
from router.worker_pool import InstanceLost, RequestChannel
from tests.router.harness import RouterThread
from tests.router.test_worker_failure import DyingWorker


class SlowDyingWorker(DyingWorker):
    """A worker that dies (once) while it holds a request, before or after its first token."""

    deaths_before_first_token: list[str] = []  # shared: the next N submits, wherever, die

    async def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        if self.deaths_before_first_token:
            self.deaths_before_first_token.pop()
            self.prefill_delay_s = 0.5  # long enough for the router to notice the loss first
            self.dead = True
        await super().submit(request, ticket)


def _collect(call: object) -> tuple[list[int], list[pb.GenerateResponse]]:
    responses = list(call)  # type: ignore[call-overload]
    return [t for r in responses for t in r.token_ids], responses


def _holder(workers: list[SlowDyingWorker]) -> SlowDyingWorker:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for worker in workers:
            if worker._sequences:
                return worker
        time.sleep(0.005)
    raise AssertionError("no worker took the request")


def _router(tiny_model_dir: str, **options: object) -> RouterConfig:
    return RouterConfig(
        model_dir=tiny_model_dir, load_refresh_interval_s=0.02, worker_timeout_s=2.0, **options
    )


def _wait_for_free_pools(server: RouterThread) -> None:
    """Every block back: the lost instance's own copy of the request runs out by itself."""
    deadline = time.monotonic() + 10
    loads = server.loads()
    while any(load.num_free_blocks != load.num_total_blocks for load in loads):
        assert time.monotonic() < deadline, loads
        time.sleep(0.05)
        loads = server.loads()


def _stages(timings: pb.Timings) -> float:
    return (
        timings.router_queue_s
        + timings.prefill_queue_s
        + timings.prefill_s
        + timings.kv_transfer_s
        + timings.decode_queue_s
        + timings.decode_s
        + timings.recovery_s
    )


def test_a_stream_whose_instance_is_lost_mid_stream_migrates_and_finishes(
    tiny_model_dir: str,
) -> None:
    workers = [
        SlowDyingWorker(f"colocated-{i}", Role.COLOCATED, step_interval_s=0.01) for i in (0, 1)
    ]
    with RouterThread(_router(tiny_model_dir), lambda: (workers, [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=60), timeout=30)
            first = next(call)
            victim = _holder(workers)
            victim.dead = True
            rest, responses = _collect(call)
        assert server.router is not None
        registry = server.router.metrics.registry
        assert registry.get_sample_value("pdserve:request_migrations_total") == 1
        assert registry.get_sample_value("pdserve:request_retries_total") == 0
        victim.dead = False
        _wait_for_free_pools(server)
    last = responses[-1]
    assert len(first.token_ids) + len(rest) == 60  # every token once: the budget is exact
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 60
    timings = last.timings
    assert (timings.retries, timings.migrations) == (0, 1)
    assert 0 < timings.recovery_s < timings.e2e_s
    assert last.prefill_instance != victim.instance_id  # it finished elsewhere
    assert _stages(timings) == pytest.approx(timings.e2e_s, abs=0.05)


def test_a_request_whose_instance_is_lost_before_its_first_token_is_retried(
    tiny_model_dir: str,
) -> None:
    workers = [
        SlowDyingWorker(f"colocated-{i}", Role.COLOCATED, step_interval_s=0.01) for i in (0, 1)
    ]
    SlowDyingWorker.deaths_before_first_token = ["once"]  # whichever takes it first dies
    with RouterThread(_router(tiny_model_dir), lambda: (workers, [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            reply = stub.GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=20), timeout=30)
        assert server.router is not None
        registry = server.router.metrics.registry
        assert registry.get_sample_value("pdserve:request_retries_total") == 1
        victim = next(w for w in workers if w.dead)
        victim.dead = False
        _wait_for_free_pools(server)
    assert len(reply.token_ids) == 20
    assert (reply.timings.retries, reply.timings.migrations) == (1, 0)
    assert reply.prefill_instance != victim.instance_id
    # the lost placement's time, before the one that answered (synthetic workers report no
    # stages of their own: the sum is checked on real workers, tests/deploy/test_recovery.py)
    assert 0 < reply.timings.recovery_s < reply.timings.first_token_s


def test_a_request_waits_for_its_only_instance_to_come_back(tiny_model_dir: str) -> None:
    """One instance, lost mid-stream and back 1 s later (a restart): the stream goes on there."""
    worker = SlowDyingWorker("colocated-0", Role.COLOCATED, step_interval_s=0.01)
    with RouterThread(_router(tiny_model_dir), lambda: ([worker], [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=200), timeout=30)
            first = next(call)
            worker.dead = True
            threading.Timer(1.0, lambda: setattr(worker, "dead", False)).start()
            rest, responses = _collect(call)
        _wait_for_free_pools(server)
    assert len(first.token_ids) + len(rest) == 200
    assert responses[-1].timings.migrations == 1
    assert responses[-1].timings.recovery_s >= 0.5


def test_a_loss_left_in_the_channel_does_not_end_the_next_placement_on_the_same_instance() -> None:
    """The poll and load loops both report a loss; the one not yet taken when the request
    moved on must not end its next placement, on the same instance once it is back."""

    async def run() -> tuple[bool, bool]:
        channel = RequestChannel("r@0")
        channel.request_id, channel.holder_ids = "r@0.0", {"colocated-0"}
        left_over = InstanceLost("colocated-0", "its load report failed", channel.request_id)
        channel.request_id = "r@0.1"  # the next placement, on the instance come back
        now = InstanceLost("colocated-0", "polling its events failed", channel.request_id)
        progress = cast(Progress, None)  # a loss is judged by the channel alone
        return is_stale(left_over, channel, progress), is_stale(now, channel, progress)

    assert asyncio.run(run()) == (True, False)


def test_a_loss_while_recovering_counts_the_stream_down_from_the_first() -> None:
    recovery = Recovery(max_retries=3, deadline_at=None)
    lost = GenerationFailed(FailureKind.UNAVAILABLE, "lost", lost_instance="colocated-0")
    recovery.take(lost, num_tokens_sent=5)
    first_failed_at = recovery.failed_at
    time.sleep(0.01)
    recovery.take(lost, num_tokens_sent=5)
    assert (recovery.migrations, recovery.failed_at) == (2, first_failed_at)
    recovery.resumed()
    assert recovery.recovery_s >= 0.01


def test_recovery_gives_up_after_max_retries_with_unavailable_and_the_cause(
    tiny_model_dir: str,
) -> None:
    worker = SlowDyingWorker("colocated-0", Role.COLOCATED, step_interval_s=0.01)
    config = _router(tiny_model_dir, max_retries=1, recovery_wait_s=0.5)
    with RouterThread(config, lambda: ([worker], [])) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=400), timeout=30)
            next(call)
            worker.dead = True  # and never back
            with pytest.raises(grpc.RpcError) as error:
                list(call)
        worker.dead = False
        _wait_for_free_pools(server)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    details = error.value.details()
    assert "worker colocated-0 became unavailable" in details
    assert "no other worker could take the request over" in details


def test_a_request_waiting_for_a_worker_past_its_deadline_gets_deadline_exceeded(
    tiny_model_dir: str,
) -> None:
    """Not UNAVAILABLE a moment before the client's own deadline: what ended it was the wait."""
    worker = SlowDyingWorker("colocated-0", Role.COLOCATED, step_interval_s=0.01)
    with RouterThread(_router(tiny_model_dir), lambda: ([worker], [])) as server:
        worker.dead = True
        _wait_until_unroutable(server)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                stub.GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=4), timeout=1.0)
        time.sleep(0.2)  # the router's side of the call ends too
        assert server.router is not None
        failures = server.router.metrics.registry.get_sample_value(
            "pdserve:request_failure_total", {"code": "UNAVAILABLE"}
        )
        worker.dead = False
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not failures  # the router never called it UNAVAILABLE
    assert 0.9 < time.monotonic() - started < 5.0


def _wait_until_unroutable(server: RouterThread) -> None:
    assert server.router is not None
    deadline = time.monotonic() + 10
    while server.router.pool.prefill_candidates():
        assert time.monotonic() < deadline
        time.sleep(0.02)
