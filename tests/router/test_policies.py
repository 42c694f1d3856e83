"""Dispatch policies and admission control, on exact small scenarios."""

from __future__ import annotations

import asyncio

import pytest

from engine.block_pool import hash_prompt_blocks
from router.admission import AdmissionController, AdmissionFull
from router.policies import (
    InstanceState,
    LeastOutstandingTokens,
    MostFreeBlocks,
    PrefixAffinity,
    RoundRobin,
)
from router.worker_api import InstanceLoad, Role


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


def test_prefix_affinity_follows_the_longest_remembered_prefix() -> None:
    policy = PrefixAffinity(block_size=4)
    shared = list(range(10, 22))  # three full blocks
    states = [_state("a"), _state("b")]
    assert policy.select(shared + [1], states).instance_id == "a"  # nothing known: least loaded
    # b now looks less loaded, but a holds the prefix.
    states = [_state("a", tokens=50), _state("b", tokens=0)]
    assert policy.select(shared + [2, 3], states).instance_id == "a"
    assert policy.num_matching_blocks("a", hash_prompt_blocks(shared, 4)) == 3
    assert policy.num_matching_blocks("b", hash_prompt_blocks(shared, 4)) == 0
    # A different first block shares nothing, even with equal later blocks (chained hashes).
    other = [99, 98, 97, 96] + shared[4:]
    assert policy.select(other, states).instance_id == "b"


def test_prefix_affinity_gives_way_when_its_instance_is_far_more_loaded() -> None:
    policy = PrefixAffinity(block_size=4, max_imbalance_tokens=100)
    prompt = list(range(8))
    policy.select(prompt, [_state("a")])
    assert policy.select(prompt, [_state("a", tokens=100), _state("b")]).instance_id == "a"
    assert policy.select(prompt, [_state("a", tokens=101), _state("b")]).instance_id == "b"


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
