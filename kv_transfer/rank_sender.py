"""One prefill rank's data path: send a request's KV from this rank's cache to the decode ranks.

    handle = sender.start(ticket, block_ids)   # dials the channels, sends the headers
    for layer in range(num_layers):            # layerwise: right after each layer's forward
        ...compute layer...
        handle.send_layer(layer)
    handle.finish(first_token_id)              # sends the rest and the trailers; returns at once
    ... poll handle.done(); handle.wait() raises KVTransferError on failure

Sends are posted, not waited: the backend moves layer i while the model computes layer i+1.
The caller's thread only gathers (copies a message's blocks and heads into a staging buffer when
they are not one contiguous region); each transfer's poster thread hands the messages to the
backend in order and, after `finish`, waits for every send within the ticket's deadline. The
poster thread matters on CPU: gloo's isend writes to the socket in the calling thread, up to a
send buffer it sizes to the message, so posting inline would stall the model (and the next
gather) for the whole TCP copy. NCCL's isend only enqueues on its stream, so on CUDA messages are
posted inline, on the stream that produced them. Transfers of at most 1 MiB per rank are posted
inline on CPU too: the socket buffer takes them whole, and the hop to another thread would cost
more than the write (64-token requests: 1.4-2.5 ms of overhead through the poster, 0.9-1.5 ms
inline). Either way the poster thread does the waiting, and it ends a transfer that is never
finished at its deadline. The source blocks must stay referenced until the decode side
acknowledges (see KVSender).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from engine.kv_cache import KVCache
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.errors import KVTransferCancelled, KVTransferError, KVTransferTimeout
from kv_transfer.messages import KVTicket
from kv_transfer.plan import plan_transfer
from kv_transfer.rendezvous import ChannelDialer
from kv_transfer.same_node import cache_gpu, export_cache, pair_transport
from kv_transfer.send_handle import SendHandle, SendLane
from kv_transfer.staging import StagingPool
from kv_transfer.wire import STATUS_CANCELLED, STATUS_OK, WireView

logger = logging.getLogger(__name__)
_INLINE_MAX_BYTES = 1 << 20
# A send starts no later than this before the decode side withdraws (KVTicket.start_by; a quarter
# of the wait where that is shorter): room for the dial, the header's trip and clock skew.
_START_BY_MARGIN_S = 5.0


class KVRankSender:
    """The sending half of one prefill rank. `num_kv_heads` is the model's total KV heads."""

    def __init__(
        self,
        cache: KVCache,
        dialer: ChannelDialer,
        prefill_rank: int,
        num_kv_heads: int,
        export_now: bool = False,
    ) -> None:
        self.cache = cache
        self.dialer = dialer
        self.prefill_rank = prefill_rank
        self.num_kv_heads = num_kv_heads
        self.staging = StagingPool()
        self._export: bytes | None = None
        self._export_failed = False
        self._export_lock = threading.Lock()
        self._source_gpu = cache_gpu(cache.device)
        # Each pair's transport, decided when its first transfer dials (`transport`), by decode
        # endpoint: a restarted decode rank has a new one and is decided again.
        self._transports: dict[tuple[str, int, str], str] = {}
        # A serving rank that may pair on one node exports before it serves: on CPU the export
        # moves the cache into shared memory by copying it, so an export while the model writes
        # the cache would lose those writes.
        if export_now:
            self._exported()

    def _exported(self) -> bytes | None:
        """This rank's cache, exported once for same-node peers (same_node.export_cache); None
        when it cannot be (say /dev/shm is too small for it): the pair then uses the network."""
        with self._export_lock:
            if self._export is None and not self._export_failed:
                try:
                    self._export = export_cache(self.cache)
                except Exception as exc:
                    self._export_failed = True
                    logger.warning("same-node transport unavailable, using the network: %s", exc)
            return self._export

    def transport(self, ticket: KVTicket, endpoint: ChannelEndpoint, pair_key: str) -> str:
        """The pair's transport: "same_node" or "network" (same_node.pair_transport), decided
        once; "network" also where this rank's cache could not be exported."""
        key = (endpoint.host, endpoint.port, pair_key)
        with self._export_lock:
            chosen = self._transports.get(key)
        if chosen is None:
            chosen = pair_transport(
                ticket.transport, endpoint.node_id, endpoint.gpus, self._source_gpu
            )
            if chosen == "same_node" and self._exported() is None:
                chosen = "network"
            with self._export_lock:
                chosen = self._transports.setdefault(key, chosen)
        return chosen

    def links(self) -> dict[str, str]:
        """What each pair this rank sent to runs on, by pair key: "cuda-ipc" or "shared-memory"
        (same node), "nccl" or "gloo" (torch.distributed), for `pdserve status`."""
        same = "cuda-ipc" if self._source_gpu is not None else "shared-memory"
        network = "nccl" if self._source_gpu is not None else "gloo"
        with self._export_lock:
            return {
                pair: same if chosen == "same_node" else network
                for (_host, _port, pair), chosen in self._transports.items()
            }

    def start(self, ticket: KVTicket, block_ids: Sequence[int]) -> SendHandle:
        """Dial this rank's channels for `ticket` and send the headers. Blocks only for the dial
        (bounded by the ticket's deadline); a failure shows up in the handle, never raised here."""
        if len(block_ids) != len(ticket.block_ids):
            raise ValueError(
                f"request {ticket.request_id}: {len(block_ids)} source blocks for "
                f"{len(ticket.block_ids)} reserved on the decode side"
            )
        return self._open(ticket, tuple(block_ids), STATUS_OK)

    def cancel_unstarted(self, ticket: KVTicket) -> SendHandle:
        """End a transfer that will never send (the request was aborted or finished at its first
        token): dial and send only a CANCELLED header, so the decode ranks' receives end and the
        reservation is freed at once instead of at the deadline. Reads no KV. The handle is
        already finished; `wait()` raises KVTransferError (cancelled, or the failure)."""
        handle = self._open(ticket, ticket.block_ids, STATUS_CANCELLED)
        handle._finishing = True  # nothing follows the header: no payload, no trailer
        if handle.error is None:
            handle.error = KVTransferCancelled(f"request {ticket.request_id}: cancelled")
        handle._start_waiting()
        return handle

    def _open(self, ticket: KVTicket, block_ids: tuple[int, ...], status: int) -> SendHandle:
        """One lane per decode rank this rank sends to; dial each lane's channel and post its
        header."""
        plan = plan_transfer(self.num_kv_heads, ticket.prefill_tp_size, ticket.decode_tp_size)
        segments = plan.for_prefill_rank(self.prefill_rank)
        lanes = [
            SendLane(
                ticket.decode_endpoints[segment.decode_rank],
                WireView.for_ticket(self.cache, block_ids, segment.src_heads, ticket),
            )
            for segment in segments
        ]
        # See the module docstring. Below _INLINE_MAX_BYTES per rank the socket buffer takes the
        # whole transfer at once, and a thread would cost more than the write it moves.
        post_inline = self.cache.device.type != "cpu" or (
            sum(lane.view.payload_bytes for lane in lanes) <= _INLINE_MAX_BYTES
        )
        handle = SendHandle(ticket, lanes, self.dialer, self.staging, post_inline)
        margin = min(_START_BY_MARGIN_S, ticket.wait_to_start_s / 4)
        if ticket.start_by and time.time() > ticket.start_by - margin:
            late = KVTransferTimeout(
                f"request {ticket.request_id} (transfer {ticket.transfer_id}): the decode side "
                "withdraws its reservation before this send could begin; nothing sent"
            )
            for lane in lanes:
                handle._fail(lane, late)
            return handle
        for lane, segment in zip(lanes, segments, strict=True):
            pair_key = ticket.pair_key(self.prefill_rank, segment.decode_rank)
            source = None
            try:
                if self.transport(ticket, lane.endpoint, pair_key) == "same_node":
                    source = self._exported()
                lane.channel = self.dialer.dial(
                    lane.endpoint, pair_key, str(ticket.transfer_id), handle.deadline, source
                )
            except KVTransferError as exc:
                handle._fail(lane, exc)
                continue
            if handle.done():  # the deadline passed while dialing: the handle has ended
                handle._fail(lane, KVTransferTimeout(f"{handle._what(lane)}: dialed too late"))
                continue
            # Its place in the channel's stream is taken now, in dial order (streams.py).
            lane.outgoing = lane.channel.sends.open(handle._what(lane))
            lane.dst_heads = segment.dst_heads
            lane.same_node = lane.channel.same_node
            if lane.same_node:  # one message at finish; a cancel: the header alone
                if status == STATUS_CANCELLED:
                    header = lane.view.header(ticket.transfer_id, status)
                    handle._post(lane, header, 0, "header", last=True, control=True)
            elif lane.view.layerwise:
                header = lane.view.header(ticket.transfer_id, status)
                handle._post(
                    lane, header, 0, "header", last=status == STATUS_CANCELLED, control=True
                )
            elif status == STATUS_CANCELLED:  # whole mode: the header alone, without KV
                handle._post_packed(lane, status, None)
        if status == STATUS_OK and all(lane.same_node for lane in lanes):
            handle._post_inline = True  # one small message a lane: the socket takes it at once
        return handle
