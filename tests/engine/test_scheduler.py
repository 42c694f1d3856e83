"""Scheduler unit tests on exact block ids, budgets, chunk boundaries, preemption order, prefix
hits and aborts; the paged token store (scheduler_harness.py) checks every block table."""

from __future__ import annotations

import random

import pytest

from engine.outputs import StepOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.scheduler_harness import Driver, make_scheduler, next_token


def _chunk_shape(batch) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_pos, c.num_new_tokens, c.sample) for c in batch.chunks]


def test_admission_and_decode_take_exact_blocks() -> None:
    driver = Driver(make_scheduler(num_blocks=10, block_size=4))
    driver.add("a", list(range(10, 20)), max_tokens=5, ignore_eos=True)  # 10 tokens: 3 blocks
    driver.step()
    (chunk,) = driver.batches[-1].chunks
    assert (chunk.token_ids, chunk.start_pos, chunk.block_table, chunk.sample) == (
        list(range(10, 20)),
        0,
        [0, 1, 2],
        True,
    )
    driver.step()  # decode position 10: fits in block 2
    driver.step()  # position 11: still block 2
    assert driver.batches[-1].chunks[0].block_table == [0, 1, 2]
    driver.step()  # position 12 crosses into a fourth block
    assert driver.batches[-1].chunks[0].block_table == [0, 1, 2, 3]
    assert driver.batches[-1].chunks[0].start_pos == 12
    driver.run()
    assert driver.outputs[-1] == StepOutput("a", driver.outputs[-1].new_token_ids, True, "length")
    assert len(driver.requests["a"].output_token_ids) == 5
    assert driver.scheduler.block_pool.num_free_blocks == 10


def test_long_prompt_is_prefilled_in_chunks_that_sample_only_at_the_end() -> None:
    driver = Driver(make_scheduler(block_size=4, chunk_size=16, max_num_batched_tokens=16))
    driver.add("a", list(range(1, 38)), max_tokens=2)  # 37 tokens: chunks 16 + 16 + 5
    for _ in range(3):
        driver.step()
    assert [_chunk_shape(b) for b in driver.batches] == [
        [("a", 0, 16, False)],
        [("a", 16, 16, False)],
        [("a", 32, 5, True)],
    ]
    assert [len(b.chunks[0].block_table) for b in driver.batches] == [4, 8, 10]
    assert driver.outputs == [StepOutput("a", [next_token(list(range(1, 38)))])]


def test_decodes_go_first_and_prefill_chunks_fill_the_token_budget() -> None:
    driver = Driver(make_scheduler(block_size=4, chunk_size=8, max_num_batched_tokens=8))
    driver.add("a", [5, 6, 7], max_tokens=10, ignore_eos=True)
    driver.add("b", list(range(30, 50)), max_tokens=10)  # 20 tokens
    driver.step()
    assert _chunk_shape(driver.batches[-1]) == [("a", 0, 3, True), ("b", 0, 5, False)]
    driver.step()  # a decodes first; b continues with what the budget leaves (7 of 15)
    assert _chunk_shape(driver.batches[-1]) == [("a", 3, 1, True), ("b", 5, 7, False)]
    driver.add("c", [1, 2], max_tokens=1)
    driver.step()  # 1 + 7 = 8: c waits for budget
    assert _chunk_shape(driver.batches[-1]) == [("a", 4, 1, True), ("b", 12, 7, False)]
    driver.step()  # b has 1 token left: it is scheduled with the decodes, then c is admitted
    assert _chunk_shape(driver.batches[-1]) == [
        ("a", 5, 1, True),
        ("b", 19, 1, True),
        ("c", 0, 2, True),
    ]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    driver = Driver(make_scheduler(max_num_seqs=2))
    for i in range(3):
        driver.add(f"r{i}", [i + 1, 7, 9], max_tokens=3, ignore_eos=True)
    driver.step()
    assert [c.request_id for c in driver.batches[-1].chunks] == ["r0", "r1"]
    assert driver.scheduler.stats().num_waiting == 1
    assert all(len(tokens) == 3 for tokens in driver.run().values())


def test_prefix_cache_reuses_full_blocks_and_counts_the_skipped_tokens() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    driver = Driver(scheduler)
    shared = list(range(40, 50))  # 10 tokens: 2 full blocks + 2
    driver.add("a", shared + [1], max_tokens=3, ignore_eos=True)
    driver.run()
    a_blocks = driver.batches[0].chunks[0].block_table
    computed_before = driver.store.num_computed_tokens
    b = driver.add("b", shared + [2, 3, 4], max_tokens=3, ignore_eos=True)
    driver.step()
    (chunk,) = driver.batches[-1].chunks
    assert chunk.block_table[:2] == a_blocks[:2]  # the two shared blocks are reused
    assert (chunk.start_pos, chunk.token_ids) == (8, shared[8:] + [2, 3, 4])
    assert b.num_cached_tokens == 8
    assert driver.store.num_computed_tokens - computed_before == 5
    stats = scheduler.stats()
    assert (stats.num_prefix_hit_tokens, stats.num_prefix_queried_tokens) == (8, 11 + 13)
    driver.run()
    # Same output as computing from scratch.
    fresh = Driver(make_scheduler(num_blocks=16, block_size=4, enable_caching=False))
    fresh.add("b", shared + [2, 3, 4], max_tokens=3, ignore_eos=True)
    assert fresh.run()["b"] == b.output_token_ids


def test_prefix_hit_never_covers_the_last_prompt_token() -> None:
    driver = Driver(make_scheduler(num_blocks=16, block_size=4))
    prompt = list(range(60, 68))  # exactly 2 blocks
    driver.add("a", prompt, max_tokens=1)
    driver.run()
    b = driver.add("b", prompt, max_tokens=1)
    driver.step()
    assert _chunk_shape(driver.batches[-1]) == [("b", 4, 4, True)]  # block 2 is recomputed
    assert b.num_cached_tokens == 4
    assert b.output_token_ids == driver.requests["a"].output_token_ids


def test_running_requests_share_cached_blocks_by_reference() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    driver = Driver(scheduler)
    driver.add("a", list(range(1, 10)), max_tokens=20, ignore_eos=True)
    driver.step()
    driver.add("b", list(range(1, 9)) + [50, 51], max_tokens=20, ignore_eos=True)
    driver.step()
    a_table = scheduler.requests["a"].block_table
    b_table = scheduler.requests["b"].block_table
    assert b_table[:2] == a_table[:2] and b_table[2] not in a_table
    assert [scheduler.block_pool.ref_cnt(b) for b in a_table[:2]] == [2, 2]
    driver.run()
    assert scheduler.block_pool.num_free_blocks == 16
    scheduler.block_pool.check_integrity()


def test_preemption_takes_the_newest_request_and_recomputes_it_identically() -> None:
    prompts = {f"r{i}": [i + 1] * 6 for i in range(3)}

    def run(num_blocks: int) -> tuple[dict[str, list[int]], Driver]:
        driver = Driver(make_scheduler(num_blocks=num_blocks, block_size=4, enable_caching=False))
        for request_id, prompt in prompts.items():
            driver.add(request_id, prompt, max_tokens=12, ignore_eos=True)
        return driver.run(), driver

    reference, _ = run(num_blocks=64)
    outputs, driver = run(num_blocks=10)  # 3 x 5 blocks needed at the end: 10 is too few
    assert outputs == reference
    scheduler = driver.scheduler
    assert scheduler.num_preemptions >= 1
    assert driver.requests["r2"].num_preemptions >= 1  # the newest goes first
    assert driver.requests["r0"].num_preemptions == 0
    assert scheduler.block_pool.num_free_blocks == 10
    scheduler.block_pool.check_integrity()


def test_preempted_request_goes_back_to_the_front_of_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    driver = Driver(scheduler)
    driver.add("a", [1] * 4, max_tokens=8, ignore_eos=True)  # needs 3 blocks at its longest
    driver.add("b", [2] * 3, max_tokens=4, ignore_eos=True)
    driver.step()  # a: block 0, b: block 1
    driver.add("c", [3] * 3, max_tokens=2, ignore_eos=True)
    driver.step()  # a crosses into a 2nd block; c admitted into the last one
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    assert scheduler.block_pool.num_free_blocks == 0
    driver.step()  # b crosses a block boundary: c (newest) is preempted, then b gets its block
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert driver.requests["c"].status == RequestStatus.PREEMPTED
    assert [c.request_id for c in driver.batches[-1].chunks] == ["a", "b"]
    driver.run()
    assert scheduler.num_preemptions == driver.requests["c"].num_preemptions


def test_request_that_can_never_fit_ends_with_an_error_and_others_run() -> None:
    driver = Driver(make_scheduler(num_blocks=4, block_size=4))
    driver.add("huge", [1] * 10, max_tokens=20)  # 30 tokens = 8 blocks > 4
    driver.add("ok", [2] * 3, max_tokens=2, ignore_eos=True)
    outputs = driver.run()
    error = next(o for o in driver.outputs if o.request_id == "huge")
    assert (error.finished, error.finish_reason, error.new_token_ids) == (True, "error", [])
    assert "8 KV blocks" in (error.error or "") and "4 blocks" in (error.error or "")
    assert outputs["huge"] == [] and len(outputs["ok"]) == 2


@pytest.mark.parametrize(
    ("params", "max_model_len", "reason", "num_tokens"),
    [
        ({"max_tokens": 4}, 1024, "length", 4),
        ({"max_tokens": 50}, 12, "length", 4),  # 8 prompt tokens + 4 = max_model_len
        ({"max_tokens": 50, "stop_token_ids": ("third",)}, 1024, "stop", 3),
        ({"max_tokens": 50, "stop_token_ids": ("third",), "ignore_eos": True}, 1024, "stop", 3),
    ],
)
def test_stop_conditions(params: dict, max_model_len: int, reason: str, num_tokens: int) -> None:
    prompt = list(range(20, 28))
    probe = Driver(make_scheduler())
    probe.add("p", prompt, max_tokens=3, ignore_eos=True)
    third = probe.run()["p"][2]
    params = {
        **params,
        "stop_token_ids": tuple(
            third if s == "third" else s for s in params.get("stop_token_ids", ())
        ),
    }
    driver = Driver(make_scheduler(max_model_len=max_model_len))
    driver.add("r", prompt, **params)
    assert len(driver.run()["r"]) == num_tokens
    assert driver.outputs[-1].finish_reason == reason


def test_eos_stops_unless_ignore_eos() -> None:
    scheduler = make_scheduler()
    scheduler.eos_token_ids = frozenset({next_token(list(range(20, 28)))})  # the first token
    driver = Driver(scheduler)
    driver.add("stops", list(range(20, 28)), max_tokens=5)
    driver.add("ignores", list(range(20, 28)), max_tokens=5, ignore_eos=True)
    outputs = driver.run()
    assert len(outputs["stops"]) == 1 and len(outputs["ignores"]) == 5
    reasons = {o.request_id: o.finish_reason for o in driver.outputs if o.finished}
    assert reasons == {"stops": "stop", "ignores": "length"}


def test_add_request_rejects_what_cannot_run_and_seeds_sampling_requests() -> None:
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(Request("l", [1] * 8, SamplingParams()))
    greedy = Request("g", [1], SamplingParams())
    sampled = Request("s", [1], SamplingParams(temperature=1.0))
    scheduler.add_request(greedy)
    scheduler.add_request(sampled)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("g", [1], SamplingParams()))
    assert greedy.params.seed is None and sampled.params.seed is not None


def _abort_in_state(state: str) -> Driver:
    """A driver with request 'x' in `state` (plus a neighbour 'n' to share the pool)."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, chunk_size=4, max_num_batched_tokens=8)
    driver = Driver(scheduler)
    driver.add("n", [9] * 4, max_tokens=12, ignore_eos=True)
    driver.step()
    if state == "waiting":
        driver.add("x", [7] * 10, max_tokens=4)
        return driver
    driver.add("x", [7] * 10, max_tokens=12, ignore_eos=True)
    driver.step()  # x: first chunk of 4 of 10
    if state == "prefilling":
        assert scheduler.requests["x"].num_computed_tokens == 4
        return driver
    driver.step()
    driver.step()
    if state == "decoding":
        assert scheduler.requests["x"].num_output_tokens >= 1
        return driver
    for _ in range(50):  # n and x grow until the 6 blocks run out and x, the newest, yields
        if scheduler.requests["x"].status == RequestStatus.PREEMPTED:
            return driver
        driver.step()
    raise AssertionError("x was never preempted")


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_every_state_frees_every_block_once(state: str) -> None:
    driver = _abort_in_state(state)
    scheduler = driver.scheduler
    assert scheduler.abort("x")
    assert not scheduler.abort("x")  # already gone: nothing freed twice
    scheduler.block_pool.check_integrity()
    outputs = driver.step()
    assert StepOutput("x", [], True, "abort") in outputs
    driver.run()
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
    scheduler.block_pool.check_integrity()


def test_abort_while_the_step_runs_drops_its_result() -> None:
    driver = Driver(make_scheduler())
    driver.add("x", [1, 2, 3], max_tokens=4)
    batch = driver.scheduler.schedule()
    sampled = driver.store.execute(batch, driver.scheduler.requests)
    driver.scheduler.abort("x")
    assert driver.scheduler.update(batch, sampled) == [StepOutput("x", [], True, "abort")]
    assert driver.scheduler.block_pool.num_free_blocks == 64


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_match_an_unconstrained_run(seed: int) -> None:
    """Small pools, chunking, caching, aborts: the survivors' outputs equal a roomy run's."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 90) for _ in range(12)]
    workload = []
    for i in range(10):
        prompt = shared[: rng.randrange(0, 13)] + [
            rng.randrange(1, 90) for _ in range(rng.randrange(1, 11))
        ]
        workload.append((f"r{i}", prompt, rng.randrange(1, 15), rng.randrange(0, 12)))
    aborted = {rid for rid, *_ in rng.sample(workload, 2)}

    def run(**kwargs: int | bool) -> tuple[dict[str, list[int]], Driver]:
        driver = Driver(make_scheduler(**kwargs))
        for step in range(200):
            for rid, prompt, max_tokens, arrival in workload:
                if arrival == step:
                    driver.add(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
            if step == 6:
                for rid in sorted(aborted):
                    driver.scheduler.abort(rid)
            driver.step()
        return driver.run(), driver

    reference, _ = run(num_blocks=200, enable_caching=False)
    outputs, driver = run(
        num_blocks=10,
        block_size=4,
        chunk_size=rng.choice([3, 4, 8]),
        max_num_batched_tokens=9,
        max_num_seqs=rng.choice([2, 4]),
    )
    for rid in reference.keys() - aborted:
        assert outputs[rid] == reference[rid], rid
    pool = driver.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
