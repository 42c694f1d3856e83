"""The colocated worker (the baseline: a Worker with no KV connector side): greedy outputs equal engine.LLM's and transformers' in-process
and in a real child process, abort in each stage frees every block, a tiny pool preempts with
identical outputs, and a full queue answers Overloaded. Tiny llama, float64."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from deploy.runtime.local.process_host import ProcessWorker
from engine import LLM, EngineConfig, SamplingParams
from engine.request import Request, RequestStatus
from tests.engine.test_llm import hf_greedy, make_prompts
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import (
    Abort,
    Load,
    Overloaded,
    PollEvents,
    Role,
    Submit,
    TokenEvent,
    WorkerRequest,
)

MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# chunk 16 under a budget of 32: long prompts are prefilled in chunks that share steps with the
# decodes of the shorter ones, the colocated (SARATHI) schedule.
ENGINE_KWARGS = {
    "dtype": "float64",
    "block_size": 8,
    "num_kv_blocks": 128,
    "chunk_size": 16,
    "max_num_batched_tokens": 32,
}
PROMPTS = make_prompts((5, 70, 12, 19, 45, 33))

Poll = Callable[[float], list[TokenEvent]]


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    """transformers' greedy tokens, checked equal to engine.LLM's (default, unchunked config)."""
    model_dir = tiny_model("llama")
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    with LLM(model_dir, dtype="float64", block_size=8, num_kv_blocks=128) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert len({t for tokens in expected for t in tokens}) > 20, "degenerate reference output"
    return expected


def colocated(instance_id: str, engine: EngineConfig, **limits: int) -> Worker:
    return Worker(WorkerConfig(engine, **limits), instance_id)  # type: ignore[arg-type]


def config(model_dir: str, **overrides: object) -> EngineConfig:
    kwargs = {**ENGINE_KWARGS, **overrides}
    return EngineConfig(model_dir=model_dir, **kwargs)  # type: ignore[arg-type]


def request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> WorkerRequest:
    return WorkerRequest(request_id, prompt, params, arrival_time=time.time())


def collect(
    poll: Poll, request_ids: list[str], timeout_s: float = 30.0
) -> dict[str, list[TokenEvent]]:
    """Every event of `request_ids` until each has ended (bounded by timeout_s); events of
    other requests are dropped."""
    events: dict[str, list[TokenEvent]] = {request_id: [] for request_id in request_ids}
    pending = set(request_ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        assert time.monotonic() < deadline, f"no final event for {sorted(pending)}"
        for event in poll(0.5):
            if event.request_id not in events:
                continue
            events[event.request_id].append(event)
            if event.finish_reason is not None:
                pending.discard(event.request_id)
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for event in events for t in event.token_ids]


def check_stream(events: list[TokenEvent], num_tokens: int, source: str) -> None:
    """One token per event (one event per step), timings on the first and the last event."""
    assert [len(e.token_ids) for e in events] == [1] * num_tokens
    assert [e.finish_reason for e in events] == [None] * (num_tokens - 1) + ["length"]
    assert {e.source for e in events} == {source}
    first, last = events[0].timings, events[-1].timings
    assert first is not None and last is not None
    assert first.prefill_queue_s >= 0.0 and first.prefill_s > 0.0 and first.decode_s == 0.0
    assert last.prefill_s == first.prefill_s and last.decode_s > 0.0
    assert all(e.timings is None for e in events[1:-1])


def run_all(submit: Callable[[WorkerRequest], None], poll: Poll) -> dict[str, list[TokenEvent]]:
    request_ids = [f"r{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(request_ids, PROMPTS, strict=True):
        submit(request(request_id, prompt))
    return collect(poll, request_ids)


def test_greedy_outputs_equal_llm_and_transformers_in_process(tiny_model, reference) -> None:
    worker = colocated("colo-0", config(tiny_model("llama")))
    try:
        assert worker.role == Role.COLOCATED
        start = worker.load()
        events = run_all(worker.submit, worker.poll_events)
        for i, expected in enumerate(reference):
            assert tokens_of(events[f"r{i}"]) == expected
            check_stream(events[f"r{i}"], MAX_NEW_TOKENS, "colo-0")
        end = worker.load()
        assert (end.num_running, end.num_waiting_requests, end.num_waiting_tokens) == (0, 0, 0)
        assert end.num_free_blocks == end.num_total_blocks == start.num_free_blocks == 128
        assert (end.role, end.num_preemptions, end.healthy) == (Role.COLOCATED, 0, True)
        worker.call(worker.engine.block_pool.check_integrity)
        with pytest.raises(ValueError, match="ticket=None"):
            worker.submit(request("t", PROMPTS[0]), ticket=object())
        with pytest.raises(ValueError, match="prompt_token_ids"):
            worker.submit(request("bad", [1, 2, 100_000]))
    finally:
        worker.shutdown()


def test_prefix_hit_counts_skipped_tokens_and_equals_miss(tiny_model, reference) -> None:
    worker = colocated("colo-prefix", config(tiny_model("llama")))
    try:
        worker.submit(request("first", PROMPTS[1]))
        collect(worker.poll_events, ["first"])
        worker.submit(request("again", PROMPTS[1]))
        events = collect(worker.poll_events, ["again"])["again"]
        load = worker.load()
    finally:
        worker.shutdown()
    assert tokens_of(events) == reference[1]
    assert events[0].timings is not None and events[0].timings.num_cached_tokens == 64
    assert load.details.num_prefix_hit_tokens == 64  # 70 tokens: 8 full blocks of 8
    assert load.prefix_cache_hit_rate == pytest.approx(64 / 140)


@pytest.mark.slow
def test_process_worker_outputs_and_abort_while_decoding(tiny_model, reference) -> None:
    host = ProcessWorker(Worker, WorkerConfig(config(tiny_model("llama"))), "colo-p", name="colo-p")
    try:

        def poll(timeout_s: float) -> list[TokenEvent]:
            return host.call(PollEvents(timeout_s), timeout_s=timeout_s + 10)

        start = host.call(Load())
        events = run_all(lambda req: host.call(Submit(req, None)), poll)
        assert [tokens_of(events[f"r{i}"]) for i in range(len(PROMPTS))] == reference
        check_stream(events["r1"], MAX_NEW_TOKENS, "colo-p")

        host.call(Submit(request("doomed", PROMPTS[4], SamplingParams(max_tokens=400)), None))
        seen: list[TokenEvent] = []
        while len(tokens_of(seen)) < 3:
            seen += [e for e in poll(0.5) if e.request_id == "doomed"]
        assert host.call(Abort("doomed")) == "decoding"
        rest = collect(poll, ["doomed"])["doomed"]
        assert (rest[-1].finish_reason, rest[-1].token_ids) == ("abort", [])
        assert tokens_of(seen + rest) == reference[4][: len(tokens_of(seen + rest))]
        assert host.call(Abort("doomed")) is None
        end = host.call(Load())
        assert end.num_free_blocks == start.num_free_blocks == 128
        assert end.num_running == 0
    finally:
        host.shutdown()
    assert not host.is_alive()


def abort_when(worker: Worker, request_id: str, stage: Callable[[Request], bool]) -> int:
    """Abort `request_id` between two steps as soon as it is in `stage` (checked on the loop
    thread, so the check and the abort see the same state); returns its output token count."""

    def try_abort() -> int | None:
        engine_request = worker.engine.scheduler.requests[request_id]
        if not stage(engine_request):
            return None
        assert worker.engine.abort(request_id)
        return engine_request.num_output_tokens

    deadline = time.monotonic() + 20
    while (num_output_tokens := worker.call(try_abort)) is None:
        assert time.monotonic() < deadline, f"{request_id} never reached its stage"
    return num_output_tokens


def test_abort_in_each_stage_returns_every_block(tiny_model, reference) -> None:
    # One sequence at a time: "keeper" runs while "queued" waits; a 400-token prompt in chunks
    # of 16 spends 25 steps mid-prefill.
    worker = colocated(
        "colo-abort", config(tiny_model("llama"), max_num_seqs=1, max_num_batched_tokens=16)
    )
    long_prompt = make_prompts((400,), seed=5)[0]
    stages: dict[str, Callable[[Request], bool]] = {
        "mid-prefill": lambda r: 0 < r.num_computed_tokens < r.num_prompt_tokens,
        "decoding": lambda r: r.status == RequestStatus.RUNNING and r.num_output_tokens >= 3,
    }
    try:
        start = worker.load()
        worker.submit(request("keeper", PROMPTS[0], SamplingParams(max_tokens=300)))
        worker.submit(request("queued", PROMPTS[2]))
        abort_when(worker, "queued", lambda r: r.status == RequestStatus.WAITING)
        queued = collect(worker.poll_events, ["queued"])["queued"]
        assert [(e.token_ids, e.finish_reason) for e in queued] == [([], "abort")]
        assert worker.abort("keeper")
        collect(worker.poll_events, ["keeper"])
        for stage, reached in stages.items():
            worker.submit(request(stage, long_prompt, SamplingParams(max_tokens=100)))
            num_output_tokens = abort_when(worker, stage, reached)
            ended = collect(worker.poll_events, [stage])[stage]
            assert (ended[-1].finish_reason, ended[-1].token_ids) == ("abort", [])
            assert len(tokens_of(ended)) == num_output_tokens
            assert (num_output_tokens == 0) == (stage == "mid-prefill")
            assert worker.load().num_free_blocks == start.num_free_blocks
        end = worker.load()
        assert (end.num_running, end.num_waiting_requests, end.num_free_blocks) == (0, 0, 128)
        worker.call(worker.engine.block_pool.check_integrity)
    finally:
        worker.shutdown()


def test_tiny_pool_preempts_with_identical_outputs(tiny_model, reference) -> None:
    # The 6 sequences grow to 37..102 tokens (5..13 blocks of 8, 46 in all): 24 hold about half.
    worker = colocated("colo-tight", config(tiny_model("llama"), num_kv_blocks=24))
    try:
        events = run_all(worker.submit, worker.poll_events)
        load = worker.load()
    finally:
        worker.shutdown()
    assert [tokens_of(events[f"r{i}"]) for i in range(len(PROMPTS))] == reference
    assert load.num_preemptions > 0
    assert load.num_free_blocks == load.num_total_blocks == 24


def test_overloaded_past_the_queue_bound(tiny_model) -> None:
    worker = colocated(
        "colo-full",
        config(tiny_model("llama"), max_num_seqs=1),
        max_waiting_requests=2,
        max_queued_tokens=30,
    )
    try:
        worker.submit(request("running", PROMPTS[0], SamplingParams(max_tokens=400)))
        while not worker.poll_events(0.5):
            pass  # admitted and decoding: it no longer counts as waiting
        worker.submit(request("w1", PROMPTS[0]))  # 5 tokens
        with pytest.raises(Overloaded, match="prompt tokens queued"):
            worker.submit(request("too-long", PROMPTS[4]))  # 5 + 45 > 30
        worker.submit(request("w2", PROMPTS[2]))  # 12 tokens
        with pytest.raises(Overloaded, match="2 requests waiting"):
            worker.submit(request("w3", PROMPTS[0]))
        load = worker.load()
        assert (load.num_waiting_requests, load.num_waiting_tokens, load.num_running) == (2, 17, 1)
        for request_id in ("running", "w1", "w2"):
            assert worker.abort(request_id)
        collect(worker.poll_events, ["running", "w1", "w2"])
        assert worker.load().num_free_blocks == 128
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_a_lost_tp_rank_ends_its_requests_as_a_lost_instance(tiny_model) -> None:
    """The loop dies because a TP rank did: its requests' error events name this instance as
    the failed peer, so the router places them again (a plain crash stays INTERNAL)."""
    import os
    import signal

    worker = colocated("tp2", config(tiny_model("llama"), tensor_parallel_size=2))
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        worker.submit(request("long", PROMPTS[0], params))
        first = [e for e in worker.poll_events(5.0) if e.request_id == "long"]
        assert first and first[0].token_ids, "the request never started"
        os.kill(worker.engine.executor.worker_pids[0], signal.SIGKILL)  # TP rank 1
        (last,) = [e for e in collect(worker.poll_events, ["long"])["long"] if e.finish_reason]
    finally:
        worker.shutdown()
    assert last.finish_reason == "error" and "died" in (last.error or "")
    assert last.failed_peer == "tp2"
