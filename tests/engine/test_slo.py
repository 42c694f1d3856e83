"""The prefill gate (engine/slo.py) in the real scheduler, on a fake clock, and the step-cost
fits it prices chunks with (engine/step_costs.py)."""

from __future__ import annotations

import pytest

from engine.batch import ScheduledBatch, SequenceChunk
from engine.block_pool import BlockPool
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.slo import PrefillGate, RequestSLO, decode_slack_s
from engine.step_costs import StepCosts
from tests.engine.scheduler_harness import EOS, PagedTokenStore


def _decode_batch(batch_size: int) -> ScheduledBatch:
    return ScheduledBatch([SequenceChunk(f"d{i}", [1], 10, [0]) for i in range(batch_size)])


def _prompt_batch(num_tokens: int, start_pos: int = 0, num_decodes: int = 0) -> ScheduledBatch:
    chunks = _decode_batch(num_decodes).chunks
    chunks.append(SequenceChunk("p", [1] * num_tokens, start_pos, [0], sample=False))
    return ScheduledBatch(chunks)


def _trained_costs(decode_s: float = 0.010, per_token_s: float = 0.001) -> StepCosts:
    """Costs learned from steps that took exactly: a decode step `decode_s` at any batch, a
    prompt token `per_token_s` at any context."""
    costs = StepCosts()
    for batch_size in (1, 2, 3, 1, 2, 3):
        costs.observe(_decode_batch(batch_size), decode_s)
    for num_tokens, start in ((100, 0), (200, 0), (100, 300), (50, 0)):
        costs.observe(_prompt_batch(num_tokens, start), num_tokens * per_token_s)
    return costs


def test_step_costs_fit_lines_in_batch_size_and_context() -> None:
    costs = StepCosts()
    assert costs.decode_step_s(4) is None and costs.prefill_s(100) is None  # nothing seen yet
    for batch_size in (1, 2, 4, 8, 1, 2, 4, 8):
        costs.observe(_decode_batch(batch_size), 0.010 + 0.002 * batch_size)
    assert costs.decode_step_s(16) == pytest.approx(0.042)
    # per token: 1 ms + 2 us per token of mean context; a chunk's decodes are taken out first
    for num_tokens, start in ((64, 0), (256, 0), (128, 512), (32, 900)):
        mean_ctx = start + (num_tokens - 1) / 2
        decodes_s = 0.010 + 0.002 * 2
        costs.observe(
            _prompt_batch(num_tokens, start, 2), decodes_s + num_tokens * (1e-3 + 2e-6 * mean_ctx)
        )
    assert costs.prefill_s(100, 200) == pytest.approx(100 * (1e-3 + 2e-6 * 249.5))
    assert costs.prefill_s(0) == 0.0


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _gated(clock: _Clock, costs: StepCosts) -> Scheduler:
    return Scheduler(
        BlockPool(64),
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        chunk_size=512,
        max_model_len=1024,
        eos_token_ids=(EOS,),
        gate=PrefillGate(costs, clock),
        clock=clock,
    )


def _request(
    request_id: str, num_prompt: int, max_tokens: int, slo: RequestSLO | None, arrival: float
) -> Request:
    prompt = [1 + (i * 7 + len(request_id)) % 90 for i in range(num_prompt)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, arrival, slo=slo)


def _step(scheduler: Scheduler, store: PagedTokenStore, clock: _Clock, step_s: float) -> list[str]:
    """One step that takes `step_s` on the clock; the ids of the requests it computed."""
    batch = scheduler.schedule()
    sampled = store.execute(batch, scheduler.requests)
    clock.now += step_s
    scheduler.update(batch, sampled)
    return [chunk.request_id for chunk in batch.chunks]


def test_a_prompt_waits_for_a_tight_decode_until_its_own_ttft_cannot_wait() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()  # decode step 10 ms, prompt token 1 ms
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    # The decode: TPOT SLO 15 ms over 11 tokens, so 50 ms of slack once its prompt is done.
    scheduler.add_request(_request("tight", 8, 11, RequestSLO(1.0, 0.015), clock.now))
    assert _step(scheduler, store, clock, 0.010) == ["tight"]  # its prompt, first token
    # A 100-token prompt (100 ms) would break it; its TTFT SLO (0.5 s) allows waiting.
    scheduler.add_request(_request("loose", 100, 2, RequestSLO(0.5, 1.0), clock.now))
    held_steps = 0
    while "tight" in scheduler.requests:
        assert _step(scheduler, store, clock, 0.010) == ["tight"]
        held_steps += 1
    assert held_steps == 10 and scheduler.gate is not None and scheduler.gate.num_held == 10
    assert _step(scheduler, store, clock, 0.100) == ["loose"]  # the decode is done: it runs


def test_a_prompt_that_fits_the_slack_runs_beside_the_decode() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("tight", 8, 11, RequestSLO(1.0, 0.015), clock.now))
    _step(scheduler, store, clock, 0.010)
    # 20 tokens: 20 ms + margin (10 ms step + 5 ms) fits in 50 ms of slack
    scheduler.add_request(_request("short", 20, 2, RequestSLO(0.5, 1.0), clock.now))
    assert _step(scheduler, store, clock, 0.030) == ["tight", "short"]


def test_a_prompt_that_cannot_wait_the_decode_out_runs_at_once() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("tight", 8, 11, RequestSLO(1.0, 0.015), clock.now))
    _step(scheduler, store, clock, 0.010)
    # TTFT SLO 0.2 s for 100 ms of compute: it must start within 55 ms, the decode runs 100 ms
    # more. Waiting would not save the decode, only stall it later: the prompt runs now.
    scheduler.add_request(_request("urgent", 100, 2, RequestSLO(0.2, 1.0), clock.now))
    assert _step(scheduler, store, clock, 0.110) == ["tight", "urgent"]
    assert scheduler.gate is not None and scheduler.gate.num_held == 0


def test_a_prompt_waits_for_the_decodes_it_can_save_and_no_longer() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("short", 8, 6, RequestSLO(1.0, 0.013), clock.now))
    scheduler.add_request(_request("long", 8, 60, RequestSLO(1.0, 0.012), clock.now))
    _step(scheduler, store, clock, 0.010)
    # Both tight; "short" ends in 5 steps, well before the prompt must start (0.5 s TTFT),
    # "long" outlasts that. The prompt waits for "short" to end, then runs onto "long".
    scheduler.add_request(_request("p", 100, 2, RequestSLO(0.5, 1.0), clock.now))
    computed = [_step(scheduler, store, clock, 0.010) for _ in range(8)]
    first = next(i for i, ids in enumerate(computed) if "p" in ids)
    assert "short" not in scheduler.requests
    assert first == 5 and computed[first] == ["long", "p"], computed


def test_late_decodes_and_requests_without_slos_do_not_hold_prompts() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("late", 8, 11, RequestSLO(1.0, 0.015), clock.now))
    _step(scheduler, store, clock, 0.200)  # its first token
    _step(scheduler, store, clock, 0.200)  # one 200 ms step: 11 tokens in 15 ms each is gone
    late = scheduler.requests["late"]
    assert decode_slack_s(late, clock.now, 0.010) < 0
    scheduler.add_request(_request("p", 100, 2, RequestSLO(0.5, 1.0), clock.now))
    assert "p" in _step(scheduler, store, clock, 0.100)
    # No SLO on the decode: nothing to protect; no SLO on the prompt: nothing holds it.
    scheduler.add_request(_request("free", 8, 30, None, clock.now))
    _step(scheduler, store, clock, 0.010)
    scheduler.add_request(_request("q", 100, 2, None, clock.now))
    assert "q" in _step(scheduler, store, clock, 0.100)


def test_a_decode_past_its_target_keeps_what_its_slo_still_allows() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()  # decode step 10 ms, prompt token 1 ms
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("slipped", 8, 11, RequestSLO(1.0, 0.015), clock.now))
    _step(scheduler, store, clock, 0.010)  # its first token
    _step(scheduler, store, clock, 0.040)  # one slow step: past 0.85 x its SLO, not past it
    slipped = scheduler.requests["slipped"]
    assert decode_slack_s(slipped, clock.now, 0.010) < 0
    assert 0 < decode_slack_s(slipped, clock.now, 0.010, target=1.0) < 0.1
    # A 0.1 s prompt would break it; it ends in 9 steps, long before the prompt must start.
    scheduler.add_request(_request("p", 100, 2, RequestSLO(0.5, 1.0), clock.now))
    assert _step(scheduler, store, clock, 0.010) == ["slipped"]


def test_held_prompts_keep_their_queue_order_and_blocks_come_back() -> None:
    clock, costs = _Clock(1000.0), _trained_costs()
    scheduler = _gated(clock, costs)
    store = PagedTokenStore(64, 4)
    scheduler.add_request(_request("tight", 8, 6, RequestSLO(1.0, 0.015), clock.now))
    _step(scheduler, store, clock, 0.010)
    for name in ("a", "b"):
        scheduler.add_request(_request(name, 60, 2, RequestSLO(5.0, 1.0), clock.now))
    _step(scheduler, store, clock, 0.010)
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]
    assert all(r.block_table == [] and r.num_computed_tokens == 0 for r in scheduler.waiting)
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        _step(scheduler, store, clock, 0.010)
    assert not scheduler.has_unfinished()
    assert scheduler.block_pool.num_free_blocks == 64
    scheduler.block_pool.check_integrity()


def test_request_slo_rejects_what_is_not_a_positive_time() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            RequestSLO(bad, 1.0)
