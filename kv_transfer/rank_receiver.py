"""One decode rank's data path: receive a transfer's KV into this rank's cache.

`KVRankReceiver.receive(ticket)` returns at once with a `RecvHandle`; each channel's reader thread
(streams.RecvStream) receives the transfers in the order the sender sends them, so the decode loop
keeps stepping and polls `handle.done()`. The ticket's blocks must stay reserved until the handle
is done: until then the backend may still write into them. A receive whose header came cannot be
interrupted from this side (gloo cannot cancel a posted receive); to stop one early, tell the
prefill side (KVAbort), which finishes the protocol with a CANCELLED status, or let the deadline
pass. One whose header has not come is withdrawn at its deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache, local_kv_heads
from kv_transfer.channel import Channel, ChannelEndpoint, Posted
from kv_transfer.errors import KVTransferCancelled, KVTransferError, KVTransferTimeout
from kv_transfer.messages import KVTicket
from kv_transfer.plan import plan_transfer
from kv_transfer.receiver import RANK_REPORT_GRACE_S
from kv_transfer.rendezvous import ChannelHost
from kv_transfer.same_node import (
    ACK_COPY_ALL,
    ACK_LATE,
    ACK_WRITE,
    SPLIT_WRITE_WINDOW_S,
    SameNodeEnd,
    copy_blocks,
    end_message_len,
    export_cache,
    parse_end_message,
)
from kv_transfer.staging import StagingPool
from kv_transfer.streams import Incoming, call_at
from kv_transfer.wire import (
    CONTROL_LEN,
    MAGIC,
    STATUS_CANCELLED,
    STATUS_OK,
    Trailer,
    WireView,
    control_message,
    empty_control,
)

logger = logging.getLogger(__name__)
# After the ack of a split same-node transfer whose M2 never came: how long past the write-by the
# ack named to keep the blocks (the prefill side starts no copy after it; one is milliseconds).
_SPLIT_WRITE_GRACE_S = 1.0


@dataclass(frozen=True)
class ReceivedKV:
    """What landed: the metadata the prefill side sent after the KV."""

    request_id: str
    transfer_id: int
    first_token_id: int | None
    num_tokens: int
    first_token_at: float | None = None  # the sender's time.time() at its first token


class RecvHandle:
    """One transfer on one decode rank. `wait` returns the ReceivedKV or raises KVTransferError."""

    def __init__(self, ticket: KVTicket, num_lanes: int) -> None:
        self.ticket = ticket
        self._remaining_lanes = num_lanes
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._trailers: list[Trailer] = []  # one per lane
        self.error: KVTransferError | None = None
        self.finished_at: float | None = None  # time.monotonic() when the last lane ended
        # Per lane on CUDA, recorded after its last scatter: the blocks are whole once it has
        # passed, whichever stream the decode loop steps on.
        self._landed: list[torch.cuda.Event] = []
        if num_lanes == 0:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set() and all(event.query() for event in self._landed)

    def wait(self, timeout: float | None = None) -> ReceivedKV:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.ticket.request_id}: receive still in flight")
        for event in self._landed:
            event.synchronize()
        if self.error is not None:
            raise self.error
        trailer = self._trailers[0] if self._trailers else None
        first_token_id = trailer.first_token_id if trailer is not None else -1
        return ReceivedKV(
            self.ticket.request_id,
            self.ticket.transfer_id,
            None if first_token_id < 0 else first_token_id,
            self.ticket.num_tokens,
            trailer.first_token_at if trailer is not None else None,
        )

    def _lane_finished(
        self,
        trailer: Trailer | None,
        error: KVTransferError | None,
        landed: torch.cuda.Event | None = None,
    ) -> None:
        with self._lock:
            if trailer is not None:
                self._trailers.append(trailer)
            if landed is not None:
                self._landed.append(landed)
            if error is not None and self.error is None:
                self.error = error
            self._remaining_lanes -= 1
            if self._remaining_lanes == 0:
                self.finished_at = time.monotonic()
                self._finished.set()


class KVRankReceiver:
    """The receiving half of one decode rank. `num_kv_heads` is the model's total KV heads."""

    def __init__(
        self,
        cache: KVCache,
        host: ChannelHost,
        decode_rank: int,
        num_kv_heads: int,
        export_now: bool = False,
    ) -> None:
        self.cache = cache
        self.host = host
        self.decode_rank = decode_rank
        self.num_kv_heads = num_kv_heads
        self.staging = StagingPool()
        # A CPU cache that may pair on its node is exported before serving (the export moves it
        # into shared memory by copying it, which must not race the model's writes), so that a
        # same-node prefill rank can write part of a large transfer itself (same_node.py).
        self._export: bytes | None = None
        if export_now and cache.device.type == "cpu":
            try:
                self._export = export_cache(cache)
            except Exception as exc:
                logger.warning(
                    "the decode cache cannot be shared; same-node copies stay here: %s", exc
                )

    @property
    def endpoint(self) -> ChannelEndpoint:
        return self.host.endpoint

    def receive(self, ticket: KVTicket) -> RecvHandle:
        """Start receiving `ticket`'s KV into `ticket.block_ids` of this rank's cache."""
        deadline = time.monotonic() + ticket.wait_to_start_s  # for the header; see _Lane
        plan = plan_transfer(self.num_kv_heads, ticket.prefill_tp_size, ticket.decode_tp_size)
        local = local_kv_heads(self.num_kv_heads, ticket.decode_tp_size, self.decode_rank)
        if len(local) != self.cache.spec.num_kv_heads:
            raise ValueError(
                f"decode rank {self.decode_rank} holds {self.cache.spec.num_kv_heads} KV heads, "
                f"but TP={ticket.decode_tp_size} over {self.num_kv_heads} heads gives {len(local)}"
            )
        segments = plan.for_decode_rank(self.decode_rank)
        handle = RecvHandle(ticket, len(segments))
        for segment in segments:
            pair_key = ticket.pair_key(segment.prefill_rank, self.decode_rank)
            channel = self.host.accept(pair_key, str(ticket.transfer_id), deadline, self._export)
            view = WireView.for_ticket(self.cache, ticket.block_ids, segment.dst_heads, ticket)
            lane = _Lane(ticket, channel, view, deadline, self.staging, handle, self._forget)
            lane.src_heads = segment.src_heads
            lane.export = self._export
            # Any transfer on this channel fits: none reserves more blocks than the cache has.
            lane.same_node_message_len = end_message_len(self.cache.spec.num_blocks)
            # The channel's reader receives it once its header arrives (streams.py); until
            # then it can be withdrawn at its deadline without touching the channel.
            channel.receives.expect(lane)
            lane.timer = call_at(deadline, lane.expire)
        return handle

    def _forget(self, lane: _Lane) -> None:
        self.host.forget_transfer(lane.channel.pair_key, str(lane.ticket.transfer_id))

    def close(self) -> None:
        self.host.close()


class _Lane(Incoming):
    """One channel's part of a receive. The channel's reader calls `receive` once the header
    arrived (posting the payload receives only then, in the sender's order); `end` runs once."""

    def __init__(
        self,
        ticket: KVTicket,
        channel: Channel,
        view: WireView,
        deadline: float,
        staging: StagingPool,
        handle: RecvHandle,
        forget: Callable[[_Lane], None],
    ) -> None:
        self.ticket = ticket
        self.transfer_id = ticket.transfer_id
        self.channel = channel
        self.view = view
        self.deadline = deadline
        self.staging = staging
        self.handle = handle
        self.forget = forget
        self.timer: threading.Timer | None = None
        self.src_heads = slice(0, 0)  # the prefill rank's local heads this lane carries
        self.export: bytes | None = None  # this rank's exported cache (same-node split)
        self.what = f"request {ticket.request_id} (transfer {ticket.transfer_id})"
        self._ended = False
        self._end_lock = threading.Lock()

    def expire(self) -> None:
        """The deadline for the header passed: withdraw it unless the reader already has it."""
        if self.channel.receives.withdraw(self):
            self.end(None, KVTransferTimeout(f"{self.what}: the sender did not start in time"))

    def end(self, result: object, error: KVTransferError | None) -> None:
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        if self.timer is not None:
            self.timer.cancel()
        try:
            self.forget(self)
        except Exception:  # noqa: S110 - the store may be closing; the key is harmless then
            pass
        trailer = result if isinstance(result, Trailer) else None
        landed = None
        if trailer is not None and self.view.cache.device.type == "cuda":
            # The scatters out of staging buffers are only queued (on this thread's stream).
            landed = torch.cuda.Event()
            landed.record()
        self.handle._lane_finished(trailer, error, landed)

    def receive(
        self, channel: Channel, header: torch.Tensor, post_next: Callable[[], None]
    ) -> Trailer:
        """The header arrived: check it, post this transfer's receives (then the next header's,
        through `post_next`) and wait for them."""
        view, what, tid = self.view, self.what, self.transfer_id
        # Raises when the stream is out of step. A same-node message holds more after it.
        status = view.check_header(header[:CONTROL_LEN], tid, what)
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled before sending")
        if channel.same_node:
            return self._receive_same_node(channel, header, post_next)
        # The send has started: the rest must follow within the transfer timeout.
        deadline = time.monotonic() + self.ticket.timeout_s
        if not view.layerwise:
            message = view.packed_buffer(self.staging)
            work = channel.irecv(message, view.tag(tid, 1))
            post_next()
            channel.wait(work, deadline, what)
            status, trailer = view.unpack(message, tid, what)
            self.staging.give(message)
            if status == STATUS_CANCELLED:
                raise KVTransferCancelled(f"{what}: the prefill side cancelled")
            return trailer
        posted = []
        for index in range(view.num_payload_messages):
            buffer, staged = view.incoming(index, self.staging)
            posted.append((channel.irecv(buffer, view.tag(tid, 1 + index)), buffer, staged))
        closing = empty_control(torch.device("cpu"))  # control: gloo
        last = 1 + view.num_payload_messages
        trailer_work = channel.irecv(closing, view.tag(tid, last), control=True)
        post_next()
        # Scatter message i while later messages are still arriving.
        for index, (work, buffer, staged) in enumerate(posted):
            channel.wait(work, deadline, f"{what} payload {index}")
            if staged:
                view.scatter(index, buffer)
                self.staging.give(buffer)
        channel.wait(trailer_work, deadline, f"{what} trailer")
        magic, trailer_tid, status, first_token_id, num_tokens, sent_at_us = closing.tolist()
        if magic != MAGIC or trailer_tid != tid:
            raise KVTransferError(f"{what}: bad trailer {closing.tolist()}")
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled mid-transfer")
        return Trailer(int(first_token_id), int(num_tokens), int(sent_at_us))

    def _receive_same_node(
        self, channel: Channel, message: torch.Tensor, post_next: Callable[[], None]
    ) -> Trailer:
        """The transfer's M1 came whole (same_node.end_message). On OK copy the source blocks out
        of the prefill rank's cache (mapped once per channel) into this transfer's; with a split,
        ack first, copy blocks [split:] while the prefill side writes [0, split), then take M2."""
        view, what, tid = self.view, self.what, self.transfer_id
        end = parse_end_message(message, len(view.block_ids))
        written: tuple[Posted, torch.Tensor] | None = None
        if end.split:  # M2's receive goes before the next header's: the stream stays in order
            buffer = empty_control(torch.device("cpu"))
            written = (channel.irecv(buffer, view.tag(tid, 1), control=True), buffer)
        post_next()  # `message` is read: its buffer may take the one after next
        magic, trailer_tid, status, first_token_id, num_tokens, sent_at_us = end.trailer
        if magic != MAGIC or trailer_tid != tid or (end.split and status != STATUS_OK):
            raise KVTransferError(f"{what}: bad trailer {end.trailer} (split {end.split})")
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled mid-transfer")
        # The prefill instance frees the source blocks RANK_REPORT_GRACE_S after the sender's
        # deadline, acked or not: past it they may hold another request's KV.
        late = time.monotonic_ns() > end.copy_by_ns
        channel.mapped_source()  # mapped (once) before any ack: a failure ends it without a hold
        # With a split, the prefill side wrote blocks [0, done) and this side copied [split:].
        done = 0 if written is None else self._split_copy(channel, end, late, written)
        if late:
            raise KVTransferCancelled(f"{what}: the source blocks' hold ended before the copy")
        if written is None:
            self._copy(channel, end, slice(None))
        elif done < end.split:  # the prefill side reached its write-by: the rest is ours
            if time.monotonic_ns() > end.copy_by_ns:  # the ack's trip and M2 took time
                raise KVTransferCancelled(f"{what}: the source blocks' hold ended")
            self._copy(channel, end, slice(done, end.split))
        if time.monotonic_ns() > end.copy_by_ns + RANK_REPORT_GRACE_S * 1e9 / 2:
            raise KVTransferCancelled(f"{what}: the copy outlasted the source blocks' hold")
        return Trailer(int(first_token_id), int(num_tokens), int(sent_at_us))

    def _split_copy(
        self,
        channel: Channel,
        end: SameNodeEnd,
        late: bool,
        written: tuple[Posted, torch.Tensor],
    ) -> int:
        """Ack M1 (the prefill side writes only once acked: from here this reader owns the
        transfer, so the blocks stay reserved), copy blocks [split:] unless `late`, take M2 and
        return how many of the first `split` blocks the prefill side wrote. If anything fails
        after an ack that let the prefill side write, the blocks are kept until the write-by the
        ack named has passed (plus a grace) before raising."""
        view, what, tid = self.view, self.what, self.transfer_id
        deadline = time.monotonic() + self.ticket.timeout_s
        write_by_ns = 0
        if late:
            answer = ACK_LATE
        elif channel.dest is not None and channel.dest == self.export:
            answer = ACK_WRITE
            # from now (however long M1 queued), and never past the source blocks' hold
            window_end = time.monotonic_ns() + int(SPLIT_WRITE_WINDOW_S * 1e9)
            write_by_ns = min(window_end, end.copy_by_ns)
        else:  # the channel was published with another cache than the one this lands in
            answer = ACK_COPY_ALL
        ack = control_message((tid, answer, write_by_ns, 0, 0), torch.device("cpu"))
        try:
            channel.wait(channel.isend(ack, view.tag(tid, 0), control=True), deadline, "ack")
            if not late:
                self._copy(channel, end, slice(end.split, None))
            work, buffer = written
            channel.wait(work, deadline, f"{what}: the prefill side's copy")
        except BaseException:  # a bug too: never free blocks the prefill side may write
            if answer == ACK_WRITE:
                hold = write_by_ns / 1e9 + _SPLIT_WRITE_GRACE_S - time.monotonic()
                time.sleep(max(0.0, hold))  # the prefill side may still be writing into them
            raise
        magic, written_tid, status, done = buffer.tolist()[:4]
        if magic != MAGIC or written_tid != tid or not 0 <= done <= end.split:
            raise KVTransferError(f"{what}: bad copy report {buffer.tolist()}")
        return int(done)

    def _copy(self, channel: Channel, end: SameNodeEnd, part: slice) -> None:
        """Copy `part` of the transfer's blocks out of the prefill rank's cache (mapped once per
        channel) into this transfer's blocks and heads."""
        view = self.view
        copy_blocks(
            channel.mapped_source(),
            self.src_heads,
            end.src_block_ids[part],
            view.cache.data,
            view.heads,
            view.block_ids[part],
        )
