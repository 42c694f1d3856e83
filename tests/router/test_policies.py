"""Dispatch policies and admission control, on exact small scenarios, and the queue counts
the policies read, through a real router."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from engine.block_pool import PrefixCacheChanges, hash_prompt_blocks
from router.admission import AdmissionController, AdmissionFull
from router.config import RouterConfig
from router.policies import (
    InstanceState,
    KVAware,
    LeastBatch,
    LeastOutstandingTokens,
    MostFreeBlocks,
    RoundRobin,
)
from router.prefix_index import PrefixIndex
from router.synthetic import SyntheticWorker
from router.worker_api import InstanceLoad, Role
from tests.router.harness import RouterThread


def _state(instance_id: str, tokens: int = 0, active: int = 0, free: int = 100, reserved: int = 0):
    load = InstanceLoad(instance_id, Role.PREFILL, num_free_blocks=free, num_total_blocks=100)
    return InstanceState(instance_id, load, tokens, active, reserved)


def test_least_outstanding_tokens_then_fewest_active_then_id() -> None:
    policy = LeastOutstandingTokens()
    states = [_state("a", 300, 1), _state("b", 100, 5), _state("c", 100, 2)]
    assert policy.select([1, 2], states).instance_id == "c"
    assert policy.select([1], [_state("z"), _state("y")]).instance_id == "y"


def test_round_robin_cycles_in_id_order() -> None:
    policy = RoundRobin()
    states = [_state("b"), _state("a"), _state("c")]
    assert [policy.select([1], states).instance_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_prefix_index_follows_the_workers_reports_and_the_routers_own_placements() -> None:
    index = PrefixIndex()
    blocks = hash_prompt_blocks(list(range(10, 22)), 4)  # three chained blocks
    index.apply("a", PrefixCacheChanges(blocks, [], snapshot=True))
    index.apply("b", PrefixCacheChanges(blocks[:1], [], snapshot=True))
    assert index.matching_blocks(blocks, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.apply("a", PrefixCacheChanges([], [blocks[1]]))  # evicted: only the leading run counts
    assert index.matching_blocks(blocks, ["a", "b"]) == {"a": 1, "b": 1}
    index.expect("b", blocks)  # placed there: it will cache them
    assert index.matching_blocks(blocks, ["a", "b"]) == {"a": 1, "b": 3}
    index.apply("b", PrefixCacheChanges([], [], snapshot=True))  # a snapshot replaces all
    index.forget("a")  # lost
    assert index.matching_blocks(blocks, ["a", "b"]) == {"a": 0, "b": 0}
    assert index.num_blocks("a") == index.num_blocks("b") == 0 and not index._holders


def test_kv_aware_weighs_the_cached_prefix_against_queued_and_running_work() -> None:
    shared = list(range(10, 26))  # four full blocks
    prompt = shared + [1, 2]  # 18 tokens; b's cache lacks 2 of them, a lacks all 18

    def choose(*states: InstanceState, prompt: list[int] = prompt, max_tokens: int = 1) -> str:
        index = PrefixIndex()
        index.apply("b", PrefixCacheChanges(hash_prompt_blocks(shared, 4), [], snapshot=True))
        return KVAware(block_size=4, index=index).select(prompt, states, max_tokens).instance_id

    assert choose(_state("a"), _state("b")) == "b"
    # b's queue (17 tokens) outweighs what its cache saves (16); 15 does not.
    assert choose(_state("a"), _state("b", tokens=17)) == "a"
    assert choose(_state("a"), _state("b", tokens=15)) == "b"
    # Each active request adds a token to each of this request's decode steps: 17 on b
    # outweigh its 16 cached tokens for one step, 2 do for 8 steps (a tie: fewer active wins).
    assert choose(_state("a"), _state("b", active=17)) == "a"
    assert choose(_state("a"), _state("b", active=15)) == "b"
    assert choose(_state("a"), _state("b", active=2), max_tokens=8) == "a"
    assert choose(_state("a"), _state("b", active=2), max_tokens=7) == "b"
    # A full hit still computes the last token: 15 queued + 1 ties a's 16, and the id decides.
    assert choose(_state("a"), _state("b", tokens=15), prompt=shared) == "a"
    assert choose(_state("a"), _state("b", tokens=14), prompt=shared) == "b"
    # Without a cached prefix: the fewest tokens and requests, then the id.
    assert choose(_state("b", active=1), _state("a", active=1), prompt=[7] * 9) == "a"
    assert choose(_state("b"), _state("a", active=1), prompt=[7] * 9) == "b"


def test_kv_aware_counts_what_a_placed_prompt_lacks_and_expects_it_cached_there() -> None:
    index = PrefixIndex()
    policy = KVAware(block_size=4, index=index)
    prompt = list(range(10, 23))  # 13 tokens, three full blocks
    assert policy.select(prompt, [_state("b"), _state("a")]).instance_id == "a"
    assert policy.placed(prompt, "a") == 13  # nothing cached: a computes it all
    # Before any report, the next prompt with that prefix follows it, even onto a busier a.
    choice = policy.select(prompt + [5], [_state("b"), _state("a", tokens=10)])
    assert choice.instance_id == "a"
    assert policy.placed(prompt + [5], "a") == 2  # 12 of its 14 tokens are expected cached
    assert index.matching_blocks(hash_prompt_blocks(prompt, 4), ["a", "b"]) == {"a": 3, "b": 0}
    assert LeastOutstandingTokens().placed(prompt, "a") == 13


def test_most_free_blocks_counts_reservations_since_the_last_report() -> None:
    policy = MostFreeBlocks()
    states = [
        _state("a", free=50, reserved=20),
        _state("b", free=40),
        _state("c", free=40, active=0),
    ]
    assert policy.select([1], states).instance_id == "b"  # 30 < 40; b and c tie, b by id
    states = [_state("b", free=40, active=3), _state("c", free=40, active=1)]
    assert policy.select([1], states).instance_id == "c"  # fewest running breaks the tie


def test_least_batch_takes_the_smallest_batch_among_the_instances_that_hold_the_request() -> None:
    policy = LeastBatch(block_size=4)
    prompt = [1] * 10  # with 6 tokens to generate: 16 tokens, 4 blocks
    roomy_but_busy = _state("a", active=5, free=90)
    quiet = _state("b", active=1, free=5, reserved=1)  # 4 free after the router's reservations
    assert policy.select(prompt, [roomy_but_busy, quiet], max_tokens=6).instance_id == "b"
    # 7 tokens to generate need 5 blocks: only a holds the request.
    assert policy.select(prompt, [roomy_but_busy, quiet], max_tokens=7).instance_id == "a"
    # Equal batches: the most free blocks; nobody holds it: the most free blocks too.
    assert policy.select(prompt, [_state("a", free=8), _state("b", free=9)]).instance_id == "b"
    crowded = [_state("a", active=0, free=2), _state("b", active=9, free=3)]
    assert policy.select(prompt, crowded, max_tokens=6).instance_id == "b"


def test_admission_runs_fifo_and_refuses_past_both_bounds() -> None:
    async def scenario() -> None:
        admission = AdmissionController(max_running=1, max_queued=2)
        first = admission.try_admit()
        second, third = admission.try_admit(), admission.try_admit()
        assert (first.running, second.running, third.running) == (True, False, False)
        with pytest.raises(AdmissionFull):
            admission.try_admit()
        order: list[str] = []

        async def wait(name: str, ticket) -> None:
            await admission.wait_until_running(ticket)
            order.append(name)

        tasks = [
            asyncio.create_task(wait("second", second)),
            asyncio.create_task(wait("third", third)),
        ]
        await asyncio.sleep(0)
        admission.release(first)
        await asyncio.sleep(0)
        assert order == ["second"] and admission.num_running == 1 and admission.num_waiting == 1
        tasks[1].cancel()  # a waiter that gives up leaves the queue
        await asyncio.gather(*tasks, return_exceptions=True)
        admission.release(third)
        assert admission.num_waiting == 0
        admission.release(second)
        admission.release(second)  # releasing twice is a no-op
        assert admission.num_running == 0
        assert admission.try_admit().running

    asyncio.run(scenario())


def test_a_prompt_counts_as_queued_until_its_first_token_only(tiny_model_dir: str) -> None:
    """The prefill policies read an instance's outstanding prompt tokens as its queue: a request
    that is decoding no longer counts there, else an instance with long decodes looks busy for good."""
    with _two_synthetic(tiny_model_dir, step_interval_s=0.05) as (pool, stub, _):
        call = stub.Generate(pb.GenerateRequest(token_ids=[5] * 40, max_tokens=200), timeout=30)
        next(call)  # the first token: the prompt is prefilled, the request decodes on
        states = {s.instance_id: s for s in pool.prefill_candidates()}
        assert states["colocated-0"].num_active_requests == 1
        assert states["colocated-0"].num_outstanding_prompt_tokens == 0
        call.cancel()
        _wait_uncounted(pool)


def test_a_burst_sees_the_placements_whose_submissions_are_still_on_the_way(
    tiny_model_dir: str,
) -> None:
    """An engine answers a submission between its steps. Arrivals meanwhile see the placements
    still on the way: four at once spread over both instances. Counted only once they had
    landed, all four would see two empty instances and take the first. A call cancelled while its submission is on the way leaves nothing counted."""
    delays = {"submit_delay_s": 0.5, "prefill_delay_s": 5.0}
    with _two_synthetic(tiny_model_dir, **delays) as (pool, stub, workers):
        request = pb.GenerateRequest(token_ids=[5] * 40, max_tokens=4)
        calls = [stub.Generate(request, timeout=30) for _ in range(4)]
        deadline = time.monotonic() + 10
        while sum(len(w._sequences) for w in workers) < 4:
            assert time.monotonic() < deadline, "the four submissions did not land"
            time.sleep(0.02)
        assert [len(w._sequences) for w in workers] == [2, 2]
        states = {s.instance_id: s for s in pool.prefill_candidates()}
        assert [states[f"colocated-{i}"].num_outstanding_prompt_tokens for i in (0, 1)] == [80, 80]
        for call in calls:
            call.cancel()
        _wait_uncounted(pool)
        late = stub.Generate(request, timeout=30)
        deadline = time.monotonic() + 10
        while not any(s.num_active_requests for s in pool.prefill_candidates()):
            assert time.monotonic() < deadline, "the last call was never counted"
            time.sleep(0.01)
        assert not any(w._sequences for w in workers)  # its submission is on the way
        late.cancel()
        _wait_uncounted(pool)


@contextlib.contextmanager
def _two_synthetic(
    tiny_model_dir: str, **options: float
) -> Iterator[tuple[Any, Any, list[SyntheticWorker]]]:
    """A real router on 127.0.0.1 over two colocated synthetic workers: (its pool, a stub, the
    workers)."""
    workers = [SyntheticWorker(f"colocated-{i}", Role.COLOCATED, **options) for i in range(2)]
    config = RouterConfig(model_dir=tiny_model_dir, load_refresh_interval_s=0.02)
    with RouterThread(config, lambda: (workers, [])) as server:
        assert server.router is not None
        with grpc.insecure_channel(server.address) as channel:
            yield server.router.pool, pb_grpc.GenerationStub(channel), workers


def _wait_uncounted(pool: Any) -> None:
    """Until no request is counted on any instance (bounded: 10 s)."""
    deadline = time.monotonic() + 10
    while any(
        s.num_active_requests or s.num_outstanding_prompt_tokens for s in pool.prefill_candidates()
    ):
        assert time.monotonic() < deadline, "a cancelled request is still counted"
        time.sleep(0.02)
