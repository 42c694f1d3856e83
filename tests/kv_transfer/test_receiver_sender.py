"""Exact behaviour of the hand-off state machines on small, hand-written scenarios."""

from __future__ import annotations

from engine.block_pool import BlockPool
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender


def make_pair(num_blocks: int = 8) -> tuple[KVReceiver, KVSender, list[tuple[str, bool]]]:
    released: list[tuple[str, bool]] = []
    receiver = KVReceiver(BlockPool(num_blocks), 4, "D", [ChannelEndpoint("127.0.0.1", 1)])
    sender = KVSender(BlockPool(num_blocks), 1, on_released=lambda r, ok: released.append((r, ok)))
    return receiver, sender, released


def test_happy_path_releases_prefill_blocks_only_after_the_ack() -> None:
    receiver, sender, released = make_pair()
    ticket = receiver.reserve(KVReserveRequest("a", 9, "P", 1))
    assert isinstance(ticket, KVTicket) and ticket.block_ids == (0, 1, 2)
    source = sender.pool.allocate(3)
    sender.start(ticket, source)
    sender.pool.free_sequence_blocks(source)  # the scheduler lets go; the transfer holds on
    assert [sender.pool.ref_cnt(b) for b in source] == [1, 1, 1]
    assert sender.on_rank_finished("a", 0) is None
    assert released == [] and sender.pool.num_free_blocks == 5
    ack = receiver.on_rank_finished("a", 0)
    assert ack == KVTransferDone("a", ticket.transfer_id, success=True)
    sender.on_done(ack)
    assert released == [("a", True)] and sender.pool.num_free_blocks == 8
    assert receiver.claim("a").block_ids == (0, 1, 2)
    assert receiver.pool.num_free_blocks == 5  # the sequence owns them now


def test_full_pool_refuses_instead_of_failing() -> None:
    receiver, _, _ = make_pair(num_blocks=4)
    assert isinstance(receiver.reserve(KVReserveRequest("a", 12, "P", 1)), KVTicket)
    refusal = receiver.reserve(KVReserveRequest("b", 8, "P", 1))
    assert refusal == KVRefusal("b", "not enough free KV blocks", 2, 1)
    assert receiver.pool.num_free_blocks == 1


def test_decode_abort_waits_for_the_receive_to_end_before_freeing() -> None:
    receiver, sender, released = make_pair()
    ticket = receiver.reserve(KVReserveRequest("a", 4, "P", 1))
    assert isinstance(ticket, KVTicket)
    sender.start(ticket, sender.pool.allocate(1))
    abort = receiver.abort("a", "client went away")
    assert abort == KVAbort("a", ticket.transfer_id, "client went away")
    assert receiver.pool.num_free_blocks == 7  # a rank may still be writing
    assert sender.on_abort(abort) is True  # the worker cancels its rank sends ...
    assert sender.on_rank_finished("a", 0, "cancelled") is None  # decode already knows
    assert released == [("a", False)]
    assert receiver.on_rank_finished("a", 0, "cancelled") is None  # ... and the receive ends
    assert receiver.pool.num_free_blocks == 8
    assert receiver.abort("a", "again") is None  # idempotent
