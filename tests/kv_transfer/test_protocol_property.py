"""Property test of the hand-off state machines (KVSender, KVReceiver) in one process.

Hypothesis drives random interleavings of reserve, send, rank completions (ok or failed), acks,
aborts from either side, message reordering, deadlines passing and other requests competing for
blocks. After every step: both pools are consistent, and no block that a rank may still be
reading or writing is free or held by anyone else. At the end, with everything drained: every
block is free again and every started transfer was released exactly once (a double free raises
in BlockPool itself).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.config import KVTransferConfig
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone
from kv_transfer.receiver import RANK_REPORT_GRACE_S, KVReceiver
from kv_transfer.sender import KVSender

NUM_BLOCKS = 12
BLOCK_SIZE = 4
TP = 2
TIMEOUT_S = 10.0
START_TIMEOUT_S = 100.0


@dataclass
class Transfer:
    """The test's model of one request's hand-off."""

    ticket: KVTicket
    prefill_seq_blocks: list[int] | None = None  # the prefill scheduler's own reference
    source_blocks: tuple[int, ...] = ()
    sending_ranks: set[int] = field(default_factory=set)
    receiving_ranks: set[int] = field(default_factory=lambda: set(range(TP)))
    started: bool = False


class HandOff(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.decode_pool = BlockPool(NUM_BLOCKS)
        self.prefill_pool = BlockPool(NUM_BLOCKS)
        endpoints = [ChannelEndpoint("127.0.0.1", 1000 + r) for r in range(TP)]
        config = KVTransferConfig(transfer_timeout_s=TIMEOUT_S, start_timeout_s=START_TIMEOUT_S)
        self.receiver = KVReceiver(
            self.decode_pool, BLOCK_SIZE, "D", endpoints, config, clock=lambda: self.now
        )
        self.released: Counter[str] = Counter()
        self.acked: set[str] = set()
        self.sender = KVSender(
            self.prefill_pool, TP, on_released=self._on_released, clock=lambda: self.now
        )
        self.transfers: dict[str, Transfer] = {}
        self.to_prefill: list[KVTransferDone | KVAbort] = []
        self.to_decode: list[KVAbort] = []
        self.decode_seqs: list[tuple[int, ...]] = []
        self.competitors: list[tuple[BlockPool, list[int]]] = []
        self.next_id = 0

    def _on_released(self, request_id: str, success: bool) -> None:
        # Released as a success only after the decode side said the KV landed.
        assert not success or request_id in self.acked, f"{request_id} released before its ack"
        self.released[request_id] += 1

    def _send_to_prefill(self, message: KVTransferDone | KVAbort | None) -> None:
        if message is not None:
            self.to_prefill.append(message)

    # ------------------------------------------------------------------ rules
    @rule(num_tokens=st.integers(1, 5 * BLOCK_SIZE))
    def reserve(self, num_tokens: int) -> None:
        self.next_id += 1
        request = KVReserveRequest(f"r{self.next_id}", num_tokens, "P", TP)
        answer = self.receiver.reserve(request)
        if isinstance(answer, KVRefusal):
            assert not self.decode_pool.can_allocate(answer.num_blocks_needed)
            return
        assert len(answer.block_ids) == -(-num_tokens // BLOCK_SIZE)
        self.transfers[request.request_id] = Transfer(answer)

    def _pick(self, data: st.DataObject, predicate) -> Transfer | None:  # noqa: ANN001
        candidates = sorted(rid for rid, t in self.transfers.items() if predicate(t))
        if not candidates:
            return None
        return self.transfers[data.draw(st.sampled_from(candidates))]

    @rule(data=st.data(), drop_own_reference=st.booleans())
    def start_sending(self, data: st.DataObject, drop_own_reference: bool) -> None:
        transfer = self._pick(data, lambda t: not t.started)
        num_blocks = 0 if transfer is None else len(transfer.ticket.block_ids)
        if transfer is None or not self.prefill_pool.can_allocate(num_blocks):
            return
        blocks = self.prefill_pool.allocate(num_blocks)
        self.sender.start(transfer.ticket, blocks)
        transfer.started = True
        transfer.source_blocks = tuple(blocks)
        transfer.sending_ranks = set(range(TP))
        if drop_own_reference:  # the scheduler is done with the sequence; the transfer holds on
            self.prefill_pool.free_sequence_blocks(blocks)
        else:
            transfer.prefill_seq_blocks = blocks

    @rule(data=st.data(), rank=st.integers(0, TP - 1), ok=st.booleans())
    def rank_send_ends(self, data: st.DataObject, rank: int, ok: bool) -> None:
        transfer = self._pick(data, lambda t: rank in t.sending_ranks)
        if transfer is not None:
            transfer.sending_ranks.discard(rank)
            rid = transfer.ticket.request_id
            abort = self.sender.on_rank_finished(rid, rank, None if ok else "peer died")
            if abort is not None:
                self.to_decode.append(abort)

    @rule(data=st.data(), rank=st.integers(0, TP - 1), ok=st.booleans())
    def rank_receive_ends(self, data: st.DataObject, rank: int, ok: bool) -> None:
        transfer = self._pick(data, lambda t: rank in t.receiving_ranks)
        if transfer is not None:
            transfer.receiving_ranks.discard(rank)
            rid = transfer.ticket.request_id
            self._send_to_prefill(
                self.receiver.on_rank_finished(rid, rank, None if ok else "timed out")
            )

    @precondition(lambda self: self.to_prefill)
    @rule(data=st.data())
    def deliver_to_prefill(self, data: st.DataObject) -> None:
        message = self.to_prefill.pop(data.draw(st.integers(0, len(self.to_prefill) - 1)))
        if isinstance(message, KVTransferDone):
            if message.success:
                self.acked.add(message.request_id)
            self.sender.on_done(message)
        else:
            self.sender.on_abort(message)  # the worker would now cancel its rank sends

    @precondition(lambda self: self.to_decode)
    @rule(data=st.data())
    def deliver_to_decode(self, data: st.DataObject) -> None:
        message = self.to_decode.pop(data.draw(st.integers(0, len(self.to_decode) - 1)))
        self.receiver.on_abort(message)

    @rule(data=st.data())
    def abort_on_prefill(self, data: st.DataObject) -> None:
        transfer = self._pick(data, lambda t: True)
        if transfer is not None:
            self._drop_prefill_sequence(transfer)
            abort = self.sender.abort(transfer.ticket.request_id, "cancelled by the client")
            if abort is not None:
                self.to_decode.append(abort)

    @rule(data=st.data())
    def abort_on_decode(self, data: st.DataObject) -> None:
        transfer = self._pick(data, lambda t: True)
        if transfer is not None:
            self._send_to_prefill(self.receiver.abort(transfer.ticket.request_id, "cancelled"))

    @rule(data=st.data())
    def claim_landed(self, data: st.DataObject) -> None:
        transfer = self._pick(data, lambda t: self.receiver.is_landed(t.ticket.request_id))
        if transfer is not None:
            self.decode_seqs.append(self.receiver.claim(transfer.ticket.request_id).block_ids)

    @precondition(lambda self: self.decode_seqs)
    @rule()
    def decode_sequence_finishes(self) -> None:
        self.decode_pool.free_sequence_blocks(self.decode_seqs.pop(0))

    @rule(data=st.data())
    def prefill_drops_sequence(self, data: st.DataObject) -> None:
        transfer = self._pick(data, lambda t: t.prefill_seq_blocks is not None)
        if transfer is not None:
            self._drop_prefill_sequence(transfer)

    @rule(on_decode=st.booleans(), num_blocks=st.integers(1, 4))
    def another_request_allocates(self, on_decode: bool, num_blocks: int) -> None:
        pool = self.decode_pool if on_decode else self.prefill_pool
        if pool.can_allocate(num_blocks):
            self.competitors.append((pool, pool.allocate(num_blocks)))
            self.check_in_flight_blocks_are_held()

    @precondition(lambda self: self.competitors)
    @rule()
    def another_request_frees(self) -> None:
        pool, blocks = self.competitors.pop(0)
        pool.free(blocks)

    @rule(ranks_die=st.booleans())
    def deadline_passes(self, ranks_die: bool) -> None:
        """Every rank's own wait has hit the deadline: it reports a timeout, or it died."""
        self.now += START_TIMEOUT_S + TIMEOUT_S + RANK_REPORT_GRACE_S + 1
        for transfer in list(self.transfers.values()):
            rid = transfer.ticket.request_id
            for rank in sorted(transfer.sending_ranks):
                if not ranks_die:
                    abort = self.sender.on_rank_finished(rid, rank, "timed out")
                    if abort is not None:
                        self.to_decode.append(abort)
            for rank in sorted(transfer.receiving_ranks):
                if not ranks_die:
                    self._send_to_prefill(self.receiver.on_rank_finished(rid, rank, "timed out"))
            transfer.sending_ranks.clear()
            transfer.receiving_ranks.clear()
        for message in self.receiver.expire():
            self._send_to_prefill(message)
        self.to_decode.extend(self.sender.expire())

    def _drop_prefill_sequence(self, transfer: Transfer) -> None:
        if transfer.prefill_seq_blocks is not None:
            self.prefill_pool.free_sequence_blocks(transfer.prefill_seq_blocks)
            transfer.prefill_seq_blocks = None

    # ------------------------------------------------------------- invariants
    @invariant()
    def pools_are_consistent(self) -> None:
        self.decode_pool.check_integrity()
        self.prefill_pool.check_integrity()
        assert all(count == 1 for count in self.released.values()), self.released

    @invariant()
    def check_in_flight_blocks_are_held(self) -> None:
        for pool, blocks in self.competitors:
            for transfer in self.transfers.values():
                if pool is self.prefill_pool and transfer.sending_ranks:
                    in_flight = set(transfer.source_blocks)
                elif pool is self.decode_pool and transfer.receiving_ranks:
                    in_flight = set(transfer.ticket.block_ids)
                else:
                    continue
                assert not in_flight & set(blocks), "a block in flight was handed out"
        for transfer in self.transfers.values():
            if transfer.sending_ranks:
                assert all(self.prefill_pool.ref_cnt(b) > 0 for b in transfer.source_blocks)
            if transfer.receiving_ranks:
                assert all(self.decode_pool.ref_cnt(b) > 0 for b in transfer.ticket.block_ids)

    def teardown(self) -> None:
        """Drain everything; then no block may be leaked and each transfer released once."""
        self.deadline_passes(ranks_die=False)
        while self.to_prefill or self.to_decode:
            if self.to_prefill:
                message = self.to_prefill.pop()
                if isinstance(message, KVTransferDone):
                    self.acked.add(message.request_id) if message.success else None
                    self.sender.on_done(message)
                else:
                    self.sender.on_abort(message)
            if self.to_decode:
                self.receiver.on_abort(self.to_decode.pop())
        for rid, transfer in self.transfers.items():
            self._drop_prefill_sequence(transfer)
            self.receiver.abort(rid, "teardown")
            self.sender.abort(rid, "teardown")
        for blocks in self.decode_seqs:
            self.decode_pool.free_sequence_blocks(blocks)
        for pool, blocks in self.competitors:
            pool.free(blocks)
        for pool in (self.decode_pool, self.prefill_pool):
            pool.check_integrity()
            assert pool.num_free_blocks == NUM_BLOCKS, "a block leaked"
        assert self.sender.num_in_flight == 0 and self.receiver.num_in_flight == 0
        started = {rid for rid, t in self.transfers.items() if t.started}
        assert set(self.released) == started
        assert all(count == 1 for count in self.released.values())


HandOff.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestHandOff = HandOff.TestCase
