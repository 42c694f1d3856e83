"""Failures in real processes over gloo: a killed peer, a stalled receiver and aborts from either
side mid-transfer. In every case the surviving side fails within its deadline, both block pools
return to their starting free count, and the channel works again on the next transfer."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from kv_transfer.messages import KVAbort, KVReserveRequest, KVTicket, KVTransferDone
from tests.kv_transfer.kv_procs import NUM_BLOCKS, Worker, start_workers

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0
NUM_TOKENS = 4 * 12 - 2  # 12 blocks of 4 tokens
BIG_HEAD_DIM = 65536  # 8 MiB per block: a transfer far larger than the socket buffers


def start_pair(
    head_dim: int = 8, layerwise: bool = True, transport: str = "network"
) -> tuple[Worker, Worker]:
    prefill, decode = start_workers(2)
    prefill.call("prefill_setup", 2, head_dim)
    decode.call("decode_setup", 2, head_dim, TIMEOUT_S, layerwise, transport)
    return prefill, decode


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode process; layerwise wire mode unless parametrized otherwise."""
    workers = start_pair(layerwise=getattr(request, "param", True))
    yield workers
    for worker in workers:
        worker.stop()


def reserve(decode: Worker, request_id: str) -> KVTicket:
    ticket = decode.call("decode_reserve", KVReserveRequest(request_id, NUM_TOKENS, "P", 1))
    assert isinstance(ticket, KVTicket)
    return ticket


def assert_failed_and_freed(prefill: Worker, decode: Worker, request_id: str) -> None:
    """Both sides end with an error within the deadline, exchange their messages, and free
    every block they held for the request (the prefill side reports one failed release)."""
    sent = prefill.call("prefill_wait", request_id)
    received = decode.call("decode_wait", request_id)
    assert_failed_and_freed_after(prefill, decode, request_id, sent, received)


def assert_failed_and_freed_after(
    prefill: Worker, decode: Worker, request_id: str, sent: dict, received: dict
) -> None:
    assert sent["error"] is not None and received["error"] is not None, (sent, received)
    assert sent["elapsed_s"] < TIMEOUT_S + 1.0 and received["elapsed_s"] < TIMEOUT_S + 1.0
    if isinstance(received["ack"], KVTransferDone):
        prefill.call("prefill_on_done", received["ack"])
    if isinstance(sent["abort"], KVAbort):
        decode.call("decode_on_abort", sent["abort"])
    status = prefill.call("prefill_status")
    assert [r for r in status["released"] if r[0] == request_id] == [(request_id, False)]
    assert status["num_free_blocks"] == NUM_BLOCKS
    assert decode.call("decode_num_free_blocks") == NUM_BLOCKS


def assert_transfer_works(prefill: Worker, decode: Worker, request_id: str) -> None:
    """A whole transfer succeeds: the channel was rebuilt after whatever broke it."""
    ticket = reserve(decode, request_id)
    prefill.call("prefill_start", ticket, None)
    assert prefill.call("prefill_wait", request_id)["error"] is None
    received = decode.call("decode_wait", request_id)
    assert received["error"] is None and received["ack"].success
    assert received["num_free_blocks"] == NUM_BLOCKS
    done = prefill.call("prefill_on_done", received["ack"])
    assert done["num_free_blocks"] == NUM_BLOCKS and done["released"][-1] == (request_id, True)


def test_killed_decode_process_fails_the_prefill_side_within_the_deadline(
    pair: tuple[Worker, Worker],
) -> None:
    prefill, decode = pair
    ticket = reserve(decode, "a")
    prefill.call("prefill_start", ticket, 1)  # one of two layers sent
    decode.process.kill()
    decode.process.join(5)
    prefill.call("prefill_finish", "a")
    sent = prefill.call("prefill_wait", "a")
    assert sent["error"] == "KVTransferError" and sent["elapsed_s"] < TIMEOUT_S
    assert sent["abort"] is not None  # for a decode side that is gone: dropped
    assert sent["num_free_blocks"] == NUM_BLOCKS and sent["released"] == [("a", False)]


@pytest.mark.parametrize("transport", ["network", "same_node"])
def test_killed_prefill_process_fails_the_decode_side_within_the_deadline(transport: str) -> None:
    prefill, decode = start_pair(transport=transport)
    try:
        ticket = reserve(decode, "a")
        prefill.call("prefill_start", ticket, 1)
        prefill.process.kill()
        received = decode.call("decode_wait", "a")
        assert received["error"] in ("KVTransferError", "KVTransferTimeout")
        assert received["elapsed_s"] < TIMEOUT_S + 0.5
        error = received["ack"].error
        assert received["ack"] == KVTransferDone("a", ticket.transfer_id, False, error)
        assert received["num_free_blocks"] == NUM_BLOCKS
    finally:
        prefill.stop()
        decode.stop()


def test_same_node_transfer_cancelled_mid_way_frees_both_and_the_channel_stays() -> None:
    prefill, decode = start_pair(transport="same_node")
    try:
        ticket = reserve(decode, "c")
        prefill.call("prefill_start", ticket, 1)
        abort = prefill.call("prefill_abort", "c")
        sent = prefill.call("prefill_wait", "c")
        received = decode.call("decode_wait", "c")
        assert received["error"] == "KVTransferCancelled", received
        decode.call("decode_on_abort", abort)
        assert_failed_and_freed_after(prefill, decode, "c", sent, received)
        assert_transfer_works(prefill, decode, "after-cancel")
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("pair", [True, False], ids=["layerwise", "whole"], indirect=True)
def test_a_reservation_outlives_a_prefill_slower_than_the_transfer_timeout(
    pair: tuple[Worker, Worker],
) -> None:
    """The decode side waits start_timeout_s for the send to begin (the prefill queue and
    compute), and transfer_timeout_s only for the data: a slow prefill is late, not failed."""
    prefill, decode = pair
    ticket = reserve(decode, "slow-prefill")
    time.sleep(TIMEOUT_S + 0.5)  # the prefill queue and compute, longer than the transfer timeout
    prefill.call("prefill_start", ticket, None)
    assert prefill.call("prefill_wait", "slow-prefill")["error"] is None
    received = decode.call("decode_wait", "slow-prefill")
    assert received["error"] is None and received["ack"].success
    done = prefill.call("prefill_on_done", received["ack"])
    assert done["num_free_blocks"] == NUM_BLOCKS and done["released"][-1] == ("slow-prefill", True)


def test_a_transfer_its_owner_never_finishes_fails_both_sides_at_the_deadline(
    pair: tuple[Worker, Worker],
) -> None:
    """The prefill side sends one layer and then neither finishes nor cancels (its step loop
    died, say): the send's poster thread still ends at the deadline, so both sides free."""
    prefill, decode = pair
    ticket = reserve(decode, "orphan")
    prefill.call("prefill_start", ticket, 1)
    sent = prefill.call("prefill_wait", "orphan")
    assert sent["error"] == "KVTransferTimeout"
    assert TIMEOUT_S - 0.5 < sent["elapsed_s"] < TIMEOUT_S + 1.0
    received = decode.call("decode_wait", "orphan")
    assert received["error"] in ("KVTransferError", "KVTransferTimeout")
    assert_failed_and_freed_after(prefill, decode, "orphan", sent, received)
    assert_transfer_works(prefill, decode, "after-orphan")


@pytest.mark.parametrize("pair", [True, False], ids=["layerwise", "whole"], indirect=True)
def test_abort_mid_transfer_from_either_side_frees_both_and_the_channel_recovers(
    pair: tuple[Worker, Worker],
) -> None:
    prefill, decode = pair
    assert_transfer_works(prefill, decode, "warm-up")
    # the prefill side aborts after one layer
    ticket = reserve(decode, "p-abort")
    prefill.call("prefill_start", ticket, 1)
    decode.call("decode_on_abort", prefill.call("prefill_abort", "p-abort"))
    assert_failed_and_freed(prefill, decode, "p-abort")
    # the decode side aborts after one layer
    ticket = reserve(decode, "d-abort")
    prefill.call("prefill_start", ticket, 1)
    prefill.call("prefill_on_abort", decode.call("decode_abort", "d-abort"))
    assert_failed_and_freed(prefill, decode, "d-abort")
    # the prefill side aborts before its prefill ran: only a CANCELLED message goes out
    ticket = reserve(decode, "never-started")
    prefill.call("prefill_cancel_unstarted", ticket)
    received = decode.call("decode_wait", "never-started")
    assert received["error"] == "KVTransferCancelled" and received["elapsed_s"] < 1.0
    assert received["num_free_blocks"] == NUM_BLOCKS
    assert prefill.call("prefill_wait", "never-started")["error"] == "KVTransferCancelled"
    assert_transfer_works(prefill, decode, "after-aborts")


def test_stalled_receiver_fails_both_sides_and_the_channel_is_rebuilt() -> None:
    prefill, decode = start_pair(head_dim=BIG_HEAD_DIM)
    try:
        ticket = reserve(decode, "stall")
        prefill.call("prefill_start", ticket, 0)  # connected, header sent
        time.sleep(0.3)
        os.kill(decode.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        prefill.call("prefill_finish", "stall")  # ~100 MB: blocks once the socket buffers fill
        sent = prefill.call("prefill_wait", "stall")
        assert sent["error"] == "KVTransferTimeout"
        assert time.monotonic() - started < TIMEOUT_S + 1.0
        assert sent["num_free_blocks"] == NUM_BLOCKS and sent["released"] == [("stall", False)]
        os.kill(decode.process.pid, signal.SIGCONT)
        received = decode.call("decode_wait", "stall")
        assert received["error"] is not None and received["num_free_blocks"] == NUM_BLOCKS
        decode.call("decode_on_abort", sent["abort"])
        assert_transfer_works(prefill, decode, "after-stall")
    finally:
        os.kill(decode.process.pid, signal.SIGCONT)
        prefill.stop()
        decode.stop()
