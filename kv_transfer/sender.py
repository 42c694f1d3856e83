"""The prefill instance's side of the hand-off: hold the source blocks until the decode side acks.

Pure bookkeeping over the prefill BlockPool; the bytes move in `KVRankSender` on each rank.

    start ──▶ SENDING ── all ranks sent + ack(success) ──▶ released (success)
                 │ a rank failed, ack(failure), abort, or deadline + grace
                 ▼
              FAILING ── last rank ended ──▶ released (failure)

`start` adds one reference to every source block (the transfer's own), so the prefill scheduler
may drop its sequence whenever it likes: a block is never handed out again while a send may
still read it. The transfer's reference is dropped exactly once, when every rank's send has ended
and the outcome is known; `on_released(request_id, success)` then tells the worker (to finish
the request, or cache its prefix, or retry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool
from kv_transfer.messages import KVAbort, KVTicket, KVTransferDone
from kv_transfer.receiver import RANK_REPORT_GRACE_S


@dataclass
class _Outgoing:
    ticket: KVTicket
    block_ids: tuple[int, ...]
    deadline: float
    pending_ranks: set[int]
    acked: bool = False
    error: str | None = None


class KVSender:
    """Tracks a prefill instance's outgoing transfers and releases their blocks exactly once."""

    def __init__(
        self,
        pool: BlockPool,
        tp_size: int,
        on_released: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.tp_size = tp_size
        self.on_released = on_released
        self._clock = clock
        self._outgoing: dict[str, _Outgoing] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._outgoing)

    def holds(self, request_id: str) -> bool:
        return request_id in self._outgoing

    def start(self, ticket: KVTicket, block_ids: Sequence[int]) -> None:
        """Take the transfer's reference on the source blocks; call before any rank sends."""
        if ticket.request_id in self._outgoing:
            raise ValueError(f"request {ticket.request_id} is already being sent")
        if len(block_ids) != len(ticket.block_ids):
            raise ValueError(
                f"request {ticket.request_id}: {len(block_ids)} source blocks, "
                f"{len(ticket.block_ids)} reserved on the decode side"
            )
        self.pool.touch(block_ids)
        deadline = self._clock() + ticket.timeout_s
        self._outgoing[ticket.request_id] = _Outgoing(
            ticket, tuple(block_ids), deadline, set(range(self.tp_size))
        )

    def on_rank_finished(
        self, request_id: str, rank: int, error: str | None = None
    ) -> KVAbort | None:
        """A rank's sends ended (error None = all posted sends completed). On failure returns the
        KVAbort for the decode side, so it frees its reservation without waiting for a deadline."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None or rank not in outgoing.pending_ranks:
            return None
        outgoing.pending_ranks.discard(rank)
        message = None
        if error is not None and outgoing.error is None:
            outgoing.error = f"prefill rank {rank}: {error}"
            message = KVAbort(request_id, outgoing.ticket.transfer_id, outgoing.error)
        self._settle(request_id)
        return message

    def on_done(self, message: KVTransferDone) -> None:
        """The decode side's ack: success means the KV landed; either way the transfer ends."""
        outgoing = self._outgoing.get(message.request_id)
        if outgoing is None or outgoing.ticket.transfer_id != message.transfer_id:
            return
        if message.success:
            outgoing.acked = True
        elif outgoing.error is None:
            outgoing.error = f"decode side: {message.error}"
        self._settle(message.request_id)

    def abort(self, request_id: str, reason: str) -> KVAbort | None:
        """Abort from this side. The worker must also cancel the request's rank sends
        (`SendHandle.cancel()`); the blocks are released once they have all ended.
        Returns the KVAbort for the decode side (None if nothing was in flight)."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None:
            return None
        if outgoing.error is None:
            outgoing.error = f"aborted: {reason}"
        self._settle(request_id)
        return KVAbort(request_id, outgoing.ticket.transfer_id, reason)

    def on_abort(self, message: KVAbort) -> bool:
        """The decode side aborted. Returns True if the worker must cancel the rank sends."""
        outgoing = self._outgoing.get(message.request_id)
        if outgoing is None or outgoing.ticket.transfer_id != message.transfer_id:
            return False
        if outgoing.error is None:
            outgoing.error = f"decode side aborted: {message.reason}"
        self._settle(message.request_id)
        return True

    def expire(self) -> list[KVAbort]:
        """End transfers past deadline + grace: ranks that never reported are presumed dead, and
        a decode side that never acked is presumed gone."""
        now = self._clock()
        aborts = []
        for request_id, outgoing in list(self._outgoing.items()):
            if now > outgoing.deadline + RANK_REPORT_GRACE_S:
                if outgoing.error is None:
                    outgoing.error = "no ack from the decode side before the deadline"
                outgoing.pending_ranks.clear()
                aborts.append(KVAbort(request_id, outgoing.ticket.transfer_id, outgoing.error))
                self._settle(request_id)
        return aborts

    def _settle(self, request_id: str) -> None:
        outgoing = self._outgoing[request_id]
        if outgoing.pending_ranks:
            return  # a rank may still read the blocks
        if outgoing.error is None and not outgoing.acked:
            return  # sent; waiting for the decode side to confirm
        del self._outgoing[request_id]
        self.pool.free_sequence_blocks(outgoing.block_ids)
        if self.on_released is not None:
            self.on_released(request_id, outgoing.error is None)
