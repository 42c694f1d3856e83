"""One instance holding both KV connector sides: it prefills for another instance, decodes
prompts another instance prefilled for it, and runs requests of its own start to end, all at
once. Greedy outputs are token-identical to transformers, and every pool returns to its start.

    P (prefill) ──KV──▶ M (mixed: sends and receives)  ──KV──▶ D (decode)
                        M also runs its own requests (submit without a ticket)

In-process workers (TP=1); the KV moves over real gloo pair channels, and control messages go
through tests.workers.test_admission's Switchboard (a queue and a delivering thread).
"""

from __future__ import annotations

import time

from engine import SamplingParams
from engine.slo import RequestSLO
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.workers.switchboard import Switchboard
from tests.workers.test_admission import NUM_BLOCKS, engine_config
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role, TokenEvent, WorkerRequest

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = make_prompts((5, 19, 33, 12, 40, 7), seed=17)


def start(board: Switchboard, model_dir: str, instance_id: str, config: WorkerConfig) -> Worker:
    worker = Worker(config, instance_id, board.send)
    board.workers[instance_id] = worker
    return worker


def collect(workers: dict[str, Worker], request_ids: set[str]) -> dict[str, list[TokenEvent]]:
    """Every event of `request_ids` from every worker, until each has ended (30 s at most)."""
    events: dict[str, list[TokenEvent]] = {request_id: [] for request_id in request_ids}
    pending = set(request_ids)
    deadline = time.monotonic() + 30.0
    while pending:
        assert time.monotonic() < deadline, f"no end for {sorted(pending)}"
        for worker in workers.values():
            for event in worker.poll_events(0.01):
                events[event.request_id].append(event)
                if event.finish_reason is not None:
                    pending.discard(event.request_id)
    return events


def test_one_instance_prefills_for_another_decodes_for_a_third_and_runs_its_own(
    board: Switchboard, tiny_model
) -> None:
    model_dir = tiny_model("llama")
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    mixed = WorkerConfig(engine_config(model_dir), Role.DECODE, sends_kv=True, receives_kv=True)
    workers = {
        "P": start(board, model_dir, "P", WorkerConfig.prefill(engine_config(model_dir))),
        "M": start(board, model_dir, "M", mixed),
        "D": start(board, model_dir, "D", WorkerConfig.decode(engine_config(model_dir))),
    }
    routes = {  # request -> (prefill instance, decode instance); None: M alone
        "m-for-d-0": ("M", "D"),
        "m-for-d-1": ("M", "D"),
        "p-for-m-0": ("P", "M"),
        "p-for-m-1": ("P", "M"),
        "m-own-0": None,
        "m-own-1": None,
    }
    for (request_id, route), prompt in zip(routes.items(), PROMPTS, strict=True):
        request = WorkerRequest(request_id, prompt, GREEDY, time.time())
        if route is None:
            workers["M"].submit(request)
            continue
        prefill_id, decode_id = route
        ticket = workers[decode_id].reserve(request, prefill_id, 1)
        workers[prefill_id].submit(request, ticket)
    events = collect(workers, set(routes))

    for (request_id, route), reference in zip(routes.items(), expected, strict=True):
        tokens = [t for event in events[request_id] for t in event.token_ids]
        assert tokens == reference, request_id
        assert events[request_id][-1].finish_reason == "length"
        sources = [event.source for event in events[request_id] if event.token_ids]
        prefill_id, decode_id = route or ("M", "M")
        assert sources[0] == prefill_id and set(sources[1:]) == {decode_id}, (request_id, sources)
    for instance_id, worker in workers.items():
        deadline = time.monotonic() + 5.0
        while worker.load().num_free_blocks != NUM_BLOCKS:  # the last acks are on their way
            assert time.monotonic() < deadline, f"{instance_id} holds blocks"
            time.sleep(0.02)
        worker.call(worker.engine.block_pool.check_integrity)


def test_two_adaptive_instances_prefill_for_each_other_and_run_their_own(
    board: Switchboard, tiny_model
) -> None:
    """The adaptive layout's pair (Role.ADAPTIVE): KV moves both ways between the same two
    instances, while each also runs requests start to end."""
    model_dir = tiny_model("llama")
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    config = WorkerConfig.adaptive(engine_config(model_dir))
    assert config.role is Role.ADAPTIVE and config.sends_kv and config.receives_kv
    assert config.engine.slo_scheduling  # its gate orders steps, never changes tokens
    workers = {i: start(board, model_dir, i, config) for i in ("A", "B")}
    routes = {  # request -> (prefill instance, decode instance)
        "a-for-b-0": ("A", "B"),
        "b-for-a-0": ("B", "A"),
        "a-own": ("A", "A"),
        "b-for-a-1": ("B", "A"),
        "a-for-b-1": ("A", "B"),
        "b-own": ("B", "B"),
    }
    slos = [RequestSLO(60.0, 0.002), RequestSLO(60.0, 30.0)] * 3  # tight and loose TPOTs
    for (request_id, (prefill_id, decode_id)), prompt, slo in zip(
        routes.items(), PROMPTS, slos, strict=True
    ):
        request = WorkerRequest(request_id, prompt, GREEDY, time.time(), slo=slo)
        ticket = None
        if prefill_id != decode_id:
            ticket = workers[decode_id].reserve(request, prefill_id, 1)
        workers[prefill_id].submit(request, ticket)
    events = collect(workers, set(routes))

    for (request_id, (prefill_id, decode_id)), reference in zip(
        routes.items(), expected, strict=True
    ):
        # A decode step may be polled before the prefill side's first token (the router
        # reorders them the same way: router/generation.py's _in_order).
        first, *rest = sorted(events[request_id], key=lambda e: e.source != prefill_id)
        assert first.source == prefill_id and {e.source for e in rest} <= {decode_id}, request_id
        tokens = [t for event in (first, *rest) for t in event.token_ids]
        assert tokens == reference, request_id
    for instance_id, worker in workers.items():
        deadline = time.monotonic() + 5.0
        while worker.load().num_free_blocks != NUM_BLOCKS:
            assert time.monotonic() < deadline, f"{instance_id} holds blocks"
            time.sleep(0.02)
        worker.call(worker.engine.block_pool.check_integrity)
        details = worker.load().details  # what the router's placer and metrics read
        assert details.decode_step_s is not None and details.decode_step_s > 0
        assert details.decode_batch is not None and details.decode_batch >= 1
        assert details.num_held_chunks is not None and details.num_held_chunks >= 0
