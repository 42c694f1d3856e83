"""The decode instance's side of the hand-off: block reservations and their lifecycle.

Pure bookkeeping over the decode BlockPool; the bytes move in `KVRankReceiver` on each rank, and
the worker tells this class when each rank's receive ended. The control plane carries the
returned messages.

    reserve ──▶ IN_FLIGHT ──all ranks ok──▶ LANDED ──claim──▶ (blocks now the sequence's)
                    │ a rank failed, abort, or deadline + grace
                    ▼
                 FAILING ──last rank ended──▶ blocks freed, entry gone

Invariant: while any rank may still be receiving, the blocks stay reserved, because the backend
may still write into them; they are freed exactly once, when the last rank has ended.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.config import KVTransferConfig
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone

# After the deadline, ranks that have not reported are presumed dead (their own waits ended by
# the deadline); this margin covers the report's trip to the instance.
RANK_REPORT_GRACE_S = 5.0


@dataclass
class _Incoming:
    ticket: KVTicket
    deadline: float
    pending_ranks: set[int]
    error: str | None = None  # first failure or abort reason; None while all is well
    tell_prefill: bool = True  # False when the prefill side already knows (it aborted)


class KVReceiver:
    """Reserves decode blocks for incoming KV and tracks each transfer until it lands or fails."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        instance_id: str,
        endpoints: Sequence[ChannelEndpoint],
        config: KVTransferConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.instance_id = instance_id
        self.endpoints = tuple(endpoints)  # one per decode rank
        self.config = config or KVTransferConfig()
        self._clock = clock
        self.kv_cache_dtype = kv_cache_dtype  # the decode cache's, named in every ticket
        self._transfer_ids = itertools.count(1)
        self._incoming: dict[str, _Incoming] = {}
        self._landed: dict[str, KVTicket] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._incoming)

    def reserve(self, request: KVReserveRequest) -> KVTicket | KVRefusal:
        """Reserve blocks for the prompt's KV, or refuse when there are too few free blocks."""
        num_blocks = -(-request.num_tokens // self.block_size)
        rid = request.request_id
        if rid in self._incoming or rid in self._landed:
            return KVRefusal(rid, "a transfer for this request is already open", num_blocks, 0)
        if not self.pool.can_allocate(num_blocks):
            return KVRefusal(
                rid, "not enough free KV blocks", num_blocks, self.pool.num_free_blocks
            )
        ticket = KVTicket(
            request_id=rid,
            transfer_id=next(self._transfer_ids),
            # one run when the pool has one: the KV then lands with no scatter copy
            block_ids=tuple(self.pool.allocate_run(num_blocks)),
            num_tokens=request.num_tokens,
            prefill_instance_id=request.prefill_instance_id,
            prefill_tp_size=request.prefill_tp_size,
            decode_instance_id=self.instance_id,
            decode_tp_size=len(self.endpoints),
            decode_endpoints=self.endpoints,
            layerwise=self.config.use_layerwise(request.num_tokens),
            timeout_s=self.config.transfer_timeout_s,
            start_timeout_s=self.config.start_timeout_s,
            min_piece_bytes=self.config.min_piece_bytes,
            transport=self.config.transport,
            kv_cache_dtype=self.kv_cache_dtype,
            start_by=time.time() + self.config.start_timeout_s + self.config.transfer_timeout_s,
        )
        deadline = self._clock() + ticket.wait_to_start_s  # the ranks' waits end by then
        self._incoming[rid] = _Incoming(ticket, deadline, set(range(len(self.endpoints))))
        return ticket

    def on_rank_finished(
        self, request_id: str, rank: int, error: str | None = None
    ) -> KVTransferDone | None:
        """A rank's receive ended (error None = success). Returns the ack for the prefill side
        once the last rank has ended (None before, or if the prefill side needs no answer)."""
        incoming = self._incoming.get(request_id)
        if incoming is None or rank not in incoming.pending_ranks:
            return None  # already settled (e.g. expired): late reports are harmless
        incoming.pending_ranks.discard(rank)
        if error is not None and incoming.error is None:
            incoming.error = f"decode rank {rank}: {error}"
        return self._settle(request_id)

    def abort(self, request_id: str, reason: str) -> KVAbort | None:
        """Abort from this side (the router cancelled, or the decode worker gave up).

        Returns the KVAbort to send to the prefill side while the transfer is in flight (it
        makes the prefill ranks finish the wire protocol, so the receives end at once)."""
        landed = self._landed.pop(request_id, None)
        if landed is not None:  # arrived but not claimed: nothing is in flight any more
            self.pool.free_sequence_blocks(landed.block_ids)
            return None
        incoming = self._incoming.get(request_id)
        if incoming is None:
            return None
        if incoming.error is None:
            incoming.error = f"aborted: {reason}"
        incoming.tell_prefill = False  # the KVAbort returned here is its answer
        self._settle(request_id)
        return KVAbort(request_id, incoming.ticket.transfer_id, reason, incoming.ticket)

    def on_abort(self, message: KVAbort) -> None:
        """The prefill side aborted; blocks are freed once every rank's receive has ended."""
        incoming = self._incoming.get(message.request_id)
        if incoming is not None and incoming.ticket.transfer_id == message.transfer_id:
            if incoming.error is None:
                incoming.error = f"prefill side aborted: {message.reason}"
            incoming.tell_prefill = False
            self._settle(message.request_id)
        elif message.request_id in self._landed:
            self.abort(message.request_id, message.reason)

    def expire(self) -> list[KVTransferDone]:
        """Settle transfers whose ranks never reported by deadline + grace (a rank died)."""
        now = self._clock()
        acks = []
        for rid, incoming in list(self._incoming.items()):
            if now > incoming.deadline + RANK_REPORT_GRACE_S:
                if incoming.error is None:
                    incoming.error = f"ranks {sorted(incoming.pending_ranks)} never reported"
                incoming.pending_ranks.clear()
                ack = self._settle(rid)
                if ack is not None:
                    acks.append(ack)
        return acks

    def claim(self, request_id: str) -> KVTicket:
        """Take a landed transfer: its blocks now belong to the caller's sequence, which frees
        them like any other block table. Raises KeyError if the KV has not landed."""
        return self._landed.pop(request_id)

    def is_landed(self, request_id: str) -> bool:
        return request_id in self._landed

    def _settle(self, request_id: str) -> KVTransferDone | None:
        incoming = self._incoming[request_id]
        if incoming.pending_ranks:
            return None  # a rank may still write into the blocks: keep them reserved
        del self._incoming[request_id]
        ticket = incoming.ticket
        if incoming.error is None:
            self._landed[request_id] = ticket
            return KVTransferDone(request_id, ticket.transfer_id, success=True)
        self.pool.free_sequence_blocks(ticket.block_ids)
        if not incoming.tell_prefill:
            return None
        return KVTransferDone(request_id, ticket.transfer_id, success=False, error=incoming.error)
