"""Transfers on one rank pair, matched strictly in posting order (as NCCL matches; the suite runs
gloo channels that way): transfers sent in another order than they were reserved, a cancel
between two of them, a cancel mid-transfer, and a reservation whose sender never comes. Every
byte that lands is checked. Real processes over gloo."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kv_transfer.channel import SPLIT_GROUPS_ENV, ordered_matching
from kv_transfer.messages import KVTicket
from tests.kv_transfer.kv_procs import Worker, start_workers

pytestmark = pytest.mark.slow

NUM_KV_HEADS = 2
_ids = itertools.count(1)
_transport = "network"  # the pair fixture's transport
_writes_half = False  # the pair fixture's prefill side writes half of each transfer itself


@pytest.fixture(scope="module", params=["network", "network-split", "same_node", "same_node-split"])
def pair(
    request: pytest.FixtureRequest, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[tuple[Worker, Worker]]:
    """One prefill rank and one decode rank: every transfer shares their one channel, over
    either transport. "network-split": headers and trailers on one gloo group, the KV on a second,
    as a CUDA channel splits them between gloo and NCCL (two streams, each in post order).
    "same_node-split": the prefill side writes the first half of every transfer's blocks into
    the decode rank's cache itself, between the decode side's ack and its copy report."""
    assert ordered_matching(), "the suite runs kv_transfer with ordered matching on"
    global _transport, _writes_half
    _transport = request.param.removesuffix("-split")
    _writes_half = request.param == "same_node-split"
    if request.param == "network-split":  # the worker processes inherit it when spawned
        monkeypatch_module.setenv(SPLIT_GROUPS_ENV, "1")
    prefill, decode = start_workers(1)[0], start_workers(1)[0]
    monkeypatch_module.delenv(SPLIT_GROUPS_ENV, raising=False)
    try:
        assert decode.call("split_channels") == (request.param == "network-split")
        if _writes_half:
            for worker in (prefill, decode):
                worker.call("split_mode", 0, 30.0)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def ticket_for(
    decode: Worker, name: str, block_ids: list[int], layerwise: bool, timeout_s: float = 20.0
) -> KVTicket:
    """A ticket on the shared pair (the same instance ids, so the same channel)."""
    return KVTicket(
        request_id=name,
        transfer_id=next(_ids),
        block_ids=tuple(block_ids),
        num_tokens=4 * len(block_ids) - 1,
        prefill_instance_id="P",
        prefill_tp_size=1,
        decode_instance_id="D",
        decode_tp_size=1,
        decode_endpoints=(decode.call("endpoint"),),
        layerwise=layerwise,
        timeout_s=timeout_s,
        min_piece_bytes=0,
        transport=_transport,
    )


def send(prefill: Worker, ticket: KVTicket, src: list[int], layers: int | None = None) -> None:
    seed = ticket.transfer_id
    prefill.call("send", ticket.request_id, ticket, 0, NUM_KV_HEADS, seed, src, 1000 + seed, layers)


def assert_landed(prefill: Worker, decode: Worker, ticket: KVTicket, src: list[int]) -> None:
    name, seed = ticket.request_id, ticket.transfer_id
    written = len(ticket.block_ids) // 2 if _writes_half else 0
    assert prefill.call("wait", name, None) == {"ok": True, "written": [written]}
    check = (seed, NUM_KV_HEADS, 1, 0, src, list(ticket.block_ids))
    result = decode.call("wait", name, check)
    result.pop("stamped_s_ago")
    assert result == {"ok": True, "first_token_id": 1000 + seed, "mismatch": None}


def test_transfers_sent_in_reverse_reservation_order_land_in_their_own_blocks(
    pair: tuple[Worker, Worker],
) -> None:
    """A long prompt reserved first, short ones after: the short ones finish first."""
    prefill, decode = pair
    plan = [  # (name, decode blocks, layerwise, source blocks): sizes differ, so do the messages
        ("long", [0, 1, 2, 3, 4, 5, 6], True, [9, 10, 11, 12, 13, 14, 15]),
        ("short-whole", [8, 9], False, [3, 1]),
        ("mid-layerwise", [12, 13, 10], True, [5, 6, 7]),
    ]
    tickets = [ticket_for(decode, name, ids, lw) for name, ids, lw, _ in plan]
    for ticket in tickets:
        decode.call("recv", ticket.request_id, ticket, 0, NUM_KV_HEADS)
    for ticket, (_, _, _, src) in reversed(list(zip(tickets, plan, strict=True))):
        send(prefill, ticket, src)
    for ticket, (_, _, _, src) in zip(tickets, plan, strict=True):
        assert_landed(prefill, decode, ticket, src)


def test_a_cancel_between_two_transfers_and_one_mid_transfer(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    first = ticket_for(decode, "first", [0, 1, 2], True)
    never = ticket_for(decode, "never", [4, 5], False)
    halfway = ticket_for(decode, "halfway", [6, 7], True)
    last = ticket_for(decode, "last", [8, 9, 10, 11], False)
    for ticket in (first, never, halfway, last):
        decode.call("recv", ticket.request_id, ticket, 0, NUM_KV_HEADS)
    send(prefill, last, [0, 1, 2, 3])
    prefill.call("cancel", "never", never, 0, NUM_KV_HEADS)
    # One layer of two sent; `first` queues behind it on the channel until it ends.
    send(prefill, halfway, [12, 13], layers=1)
    send(prefill, first, [5, 6, 7])
    prefill.call("cancel_started", "halfway")
    assert_landed(prefill, decode, last, [0, 1, 2, 3])
    assert_landed(prefill, decode, first, [5, 6, 7])
    for name in ("never", "halfway"):
        assert prefill.call("wait", name, None)["ok"] is False
        result = decode.call("wait", name, None)
        assert (result["ok"], result["error"]) == (False, "KVTransferCancelled"), result


def test_a_sender_that_never_comes_is_withdrawn_and_the_channel_stays(
    pair: tuple[Worker, Worker],
) -> None:
    prefill, decode = pair
    lost = ticket_for(decode, "lost", [0, 1], True, timeout_s=1.0)
    decode.call("recv", "lost", lost, 0, NUM_KV_HEADS)
    result = decode.call("wait", "lost", None)  # waits out its deadline (start + transfer)
    assert (result["ok"], result["error"]) == (False, "KVTransferTimeout"), result
    after = ticket_for(decode, "after", [2, 3, 4], True)
    decode.call("recv", "after", after, 0, NUM_KV_HEADS)
    send(prefill, after, [7, 8, 9])
    assert_landed(prefill, decode, after, [7, 8, 9])
    send(prefill, lost, [0, 1])  # too late: the decode side no longer expects it
    assert prefill.call("wait", "lost", None)["ok"] is False


def test_a_send_past_the_withdrawal_is_refused_and_breaks_nothing(
    pair: tuple[Worker, Worker],
) -> None:
    """A header the decode side no longer expects would break the channel and fail every
    transfer queued on it; a sender past the ticket's start_by sends nothing instead."""
    prefill, decode = pair
    late = ticket_for(decode, "late", [0, 1], True, timeout_s=2.0)
    late = replace(late, start_by=time.time() - 1.0)
    queued = ticket_for(decode, "queued", [2, 3, 4], False)
    decode.call("recv", "late", late, 0, NUM_KV_HEADS)
    decode.call("recv", "queued", queued, 0, NUM_KV_HEADS)
    send(prefill, late, [5, 6])
    result = prefill.call("wait", "late", None)
    assert (result["ok"], result["error"]) == (False, "KVTransferTimeout"), result
    send(prefill, queued, [7, 8, 9])
    assert_landed(prefill, decode, queued, [7, 8, 9])  # the channel held
    result = decode.call("wait", "late", None)  # withdrawn at its own deadline
    assert (result["ok"], result["error"]) == (False, "KVTransferTimeout"), result


def test_many_transfers_in_shuffled_order(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    tickets = [
        ticket_for(decode, f"shuffled-{i}", [i, 15 - i], layerwise=i % 2 == 0) for i in range(6)
    ]
    for ticket in tickets:
        decode.call("recv", ticket.request_id, ticket, 0, NUM_KV_HEADS)
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        send(prefill, tickets[i], [2 * i, 2 * i + 1])
    for i, ticket in enumerate(tickets):
        assert_landed(prefill, decode, ticket, [2 * i, 2 * i + 1])
