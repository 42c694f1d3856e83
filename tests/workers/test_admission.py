"""What the workers accept and refuse, and how reservations end without the router's help.

Prefill and decode workers here live in the test process (TP=1; the KV still travels over a
gloo pair channel between them); control messages go through a queue and a thread, as a deployer
would carry them, never by one worker's loop calling another's directly.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from kv_transfer.config import KVTransferConfig
from tests.workers.cluster import wait_for
from tests.workers.switchboard import Switchboard
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Overloaded, TokenEvent, WorkerRequest

BLOCK_SIZE = 8
NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def engine_config(model_dir: str, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {
        "dtype": "float64",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": NUM_BLOCKS,
    }
    kwargs.update(overrides)
    return EngineConfig(model_dir=model_dir, **kwargs)


def make_decode(
    board: Switchboard,
    model_dir: str,
    timeout_s: float = 30.0,
    watermark_blocks: int = 0,
    **overrides: Any,
) -> Worker:
    """`timeout_s` bounds both the wait for the send to start and the transfer itself."""
    config = WorkerConfig.decode(
        engine_config(model_dir, **overrides),
        KVTransferConfig(transfer_timeout_s=timeout_s, start_timeout_s=timeout_s),
        watermark_blocks=watermark_blocks,
    )
    worker = Worker(config, "d", board.send)
    board.workers["d"] = worker
    return worker


def make_prefill(board: Switchboard, model_dir: str, **overrides: Any) -> Worker:
    max_queued_tokens = overrides.pop("max_queued_tokens", 65536)
    config = WorkerConfig.prefill(
        engine_config(model_dir, **overrides), max_queued_tokens=max_queued_tokens
    )
    worker = Worker(config, "p", board.send)
    board.workers["p"] = worker
    return worker


def request(request_id: str, num_tokens: int, params: SamplingParams = GREEDY) -> WorkerRequest:
    return WorkerRequest(request_id, list(range(3, 3 + num_tokens)), params, time.time())


def events_until_end(worker: Any, request_id: str, timeout_s: float = 10.0) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    deadline = time.monotonic() + timeout_s
    while not any(e.request_id == request_id and e.finish_reason for e in events):
        assert time.monotonic() < deadline, f"no end for {request_id}: {events}"
        events.extend(worker.poll_events(0.05))
    return [e for e in events if e.request_id == request_id]


def test_reserve_takes_prompt_blocks_and_refuses_past_the_watermark(board, tiny_model) -> None:
    decode = make_decode(board, tiny_model("llama"), watermark_blocks=4)
    ticket = decode.reserve(request("a", 17), "p")  # 17 tokens: 3 blocks of 8
    assert len(ticket.block_ids) == 3 and ticket.num_tokens == 17
    assert ticket.prefill_instance_id == "p" and ticket.decode_instance_id == "d"
    load = decode.load()
    assert (load.num_free_blocks, load.num_waiting_requests) == (NUM_BLOCKS - 3, 1)
    decode.reserve(request("b", 8 * 24), "p")  # 24 blocks: 5 left, 1 over the watermark
    with pytest.raises(Overloaded, match="4 stay free"):
        decode.reserve(request("c", 9), "p")  # 2 blocks would leave 3 < 4
    assert decode.load().num_free_blocks == NUM_BLOCKS - 27  # the refusal took nothing
    decode.reserve(request("c", 8), "p")  # 1 block leaves exactly the watermark


def test_reserve_rejects_requests_that_cannot_run(board, tiny_model) -> None:
    decode = make_decode(board, tiny_model("llama"), max_model_len=64)
    with pytest.raises(ValueError, match="name the prefill instance"):
        decode.reserve(request("a", 10))
    with pytest.raises(ValueError, match="max_model_len 64"):
        decode.reserve(request("a", 64), "p")
    with pytest.raises(ValueError, match="lower max_tokens"):
        big = make_decode(Switchboard(), tiny_model("llama"), num_kv_blocks=4)
        try:
            big.reserve(request("a", 10, SamplingParams(max_tokens=40)), "p")
        finally:
            big.shutdown()
    decode.reserve(request("a", 10), "p")
    with pytest.raises(ValueError, match="already in use"):
        decode.reserve(request("a", 10), "p")
    assert decode.load().num_free_blocks == NUM_BLOCKS - 2


def test_a_reservation_nobody_serves_expires_with_an_error(board, tiny_model) -> None:
    decode = make_decode(board, tiny_model("llama"), timeout_s=0.5)
    decode.reserve(request("lonely", 20), "p")  # no prefill instance ever dials
    (event,) = events_until_end(decode, "lonely")
    assert event.finish_reason == "error" and "receiving the KV from p failed" in event.error
    assert event.failed_peer == "p"  # a broken hand-off: the router may place it again
    assert decode.load().num_free_blocks == NUM_BLOCKS


def test_abort_of_a_reservation_emits_abort_and_frees_after_the_receive_ends(
    board, tiny_model
) -> None:
    decode = make_decode(board, tiny_model("llama"), timeout_s=0.5)
    decode.reserve(request("gone", 20), "p")
    assert decode.abort("gone") == "receiving"
    assert decode.abort("gone") is None  # idempotent
    (event,) = events_until_end(decode, "gone")
    assert (event.finish_reason, event.token_ids) == ("abort", [])
    # The posted receive may still write into the blocks until it ends (at its deadline here,
    # since no prefill instance holds the request to cancel it).
    wait_for(lambda: decode.load().num_free_blocks == NUM_BLOCKS, 4.0, "the blocks freed")


def test_submit_checks_the_ticket(board, tiny_model) -> None:
    model_dir = tiny_model("llama")
    decode = make_decode(board, model_dir, block_size=16)
    prefill = make_prefill(board, model_dir)
    ticket = decode.reserve(request("a", 20), "p")  # 2 blocks of 16; the prefill needs 3 of 8
    with pytest.raises(ValueError, match="number of blocks"):
        prefill.submit(request("a", 20), ticket)
    with pytest.raises(ValueError, match="request_id"):
        prefill.submit(request("b", 20), ticket)


def test_request_ending_at_its_first_token_frees_the_decode_reservation_at_once(
    board, tiny_model
) -> None:
    """No router abort here: the prefill's CANCELLED header alone ends the decode's receive,
    long before its 30 s deadline, and the decode side stays silent (the prefill reported)."""
    model_dir = tiny_model("llama")
    decode = make_decode(board, model_dir, timeout_s=30.0)
    prefill = make_prefill(board, model_dir)
    one = request("one", 20, SamplingParams(max_tokens=1))
    prefill.submit(one, decode.reserve(one, "p"))
    (event,) = events_until_end(prefill, "one")
    assert (len(event.token_ids), event.finish_reason) == (1, "length")
    assert event.timings is not None and event.timings.prefill_s > 0
    wait_for(lambda: decode.load().num_free_blocks == NUM_BLOCKS, 5.0, "the reservation freed")
    assert decode.poll_events(0.2) == []
    assert prefill.load().num_free_blocks == NUM_BLOCKS


def test_overloaded_prefill_cancels_the_reservation(board, tiny_model) -> None:
    model_dir = tiny_model("llama")
    decode = make_decode(board, model_dir, timeout_s=30.0)
    prefill = make_prefill(board, model_dir, max_queued_tokens=16)
    big = request("big", 20)
    ticket = decode.reserve(big, "p")
    with pytest.raises(Overloaded, match="max_queued_tokens=16"):
        prefill.submit(big, ticket)
    wait_for(lambda: decode.load().num_free_blocks == NUM_BLOCKS, 5.0, "the reservation freed")
    assert prefill.load().num_waiting_requests == 0


def test_a_reserve_that_arrives_after_its_abort_is_refused(board, tiny_model) -> None:
    """Ray runs a worker's calls on several threads: a client's cancel (abort) can overtake the
    reserve it follows. The late reservation would hold its blocks until the start deadline."""
    decode = make_decode(board, tiny_model("llama"))
    assert decode.abort("late") is None  # nothing here yet
    with pytest.raises(ValueError, match="aborted before its reservation"):
        decode.reserve(request("late", 20), "p")
    assert decode.load().num_free_blocks == NUM_BLOCKS
