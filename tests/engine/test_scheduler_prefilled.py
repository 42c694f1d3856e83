"""`Scheduler.add_prefilled`: a request whose prompt KV was computed elsewhere (the decode side of a
disaggregated cluster) continues exactly as if this scheduler had prefilled it."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.scheduler_harness import Driver, make_scheduler, next_token

PROMPTS = {"a": list(range(1, 12)), "b": list(range(20, 45)), "c": [7] * 9}


def reference_outputs(max_tokens: int) -> dict[str, list[int]]:
    driver = Driver(make_scheduler())
    for rid, prompt in PROMPTS.items():
        driver.add(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
    return driver.run()


def land(driver: Driver, rid: str, prompt: list[int], max_tokens: int) -> Request:
    """What the KV receiver does: reserve blocks, write the prompt's KV, hand over the request."""
    scheduler = driver.scheduler
    bs = scheduler.block_size
    block_table = scheduler.block_pool.allocate(-(-len(prompt) // bs))
    for pos, token in enumerate(prompt):
        driver.store.slots[block_table[pos // bs]][pos % bs] = token
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    request.output_token_ids = [next_token(prompt)]  # the prefill side sampled the first token
    request.block_table = block_table
    request.num_computed_tokens = len(prompt)
    scheduler.add_prefilled(request)
    driver.requests[rid] = request
    return request


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks: landed requests get preempted
def test_prefilled_requests_continue_like_local_ones(num_blocks: int) -> None:
    expected = reference_outputs(max_tokens=20)
    driver = Driver(make_scheduler(num_blocks=num_blocks))
    pool = driver.scheduler.block_pool
    for rid, prompt in PROMPTS.items():
        land(driver, rid, prompt, max_tokens=20)
    assert driver.scheduler.stats().num_waiting == 3
    assert driver.run() == expected
    assert pool.num_free_blocks == num_blocks
    pool.check_integrity()
    if num_blocks == 14:
        assert driver.scheduler.num_preemptions > 0
    # landed requests never recompute their prompt unless preempted
    first = driver.batches[0]
    assert all(chunk.num_new_tokens == 1 for chunk in first.chunks)


def test_abort_of_a_landed_request_frees_its_blocks_once() -> None:
    driver = Driver(make_scheduler(num_blocks=16))
    pool = driver.scheduler.block_pool
    land(driver, "a", PROMPTS["a"], max_tokens=5)
    assert pool.num_free_blocks == 16 - 3
    assert driver.scheduler.abort("a")
    assert pool.num_free_blocks == 16
    pool.check_integrity()
    assert driver.step()[0].finish_reason == "abort"


def test_add_prefilled_rejects_a_request_without_its_blocks() -> None:
    scheduler = make_scheduler()
    request = Request("x", [1, 2, 3, 4, 5], SamplingParams())
    request.output_token_ids = [9]
    request.num_computed_tokens = 5
    with pytest.raises(ValueError, match="blocks"):
        scheduler.add_prefilled(request)
