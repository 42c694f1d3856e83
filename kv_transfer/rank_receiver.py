"""One decode rank's data path: receive a transfer's KV into this rank's cache.

`KVRankReceiver.receive(ticket)` returns at once with a `RecvHandle`; one thread per channel waits
for the data (the waits release the GIL), so the decode loop keeps stepping and polls
`handle.done()`. The ticket's blocks must stay reserved until the handle is done: until then the
backend may still write into them. A receive cannot be interrupted from this side (gloo cannot
cancel a posted receive); to stop one early, tell the prefill side (KVAbort), which finishes the
protocol with a CANCELLED status, or let the deadline pass.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_cache import KVCache, local_kv_heads
from kv_transfer.channel import Channel, ChannelEndpoint, ChannelHost
from kv_transfer.errors import KVTransferCancelled, KVTransferError
from kv_transfer.messages import KVTicket
from kv_transfer.plan import plan_transfer
from kv_transfer.staging import StagingPool
from kv_transfer.wire import MAGIC, STATUS_CANCELLED, Trailer, WireView, empty_control


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
        if num_lanes == 0:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> ReceivedKV:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.ticket.request_id}: receive still in flight")
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

    def _lane_finished(self, trailer: Trailer | None, error: KVTransferError | None) -> None:
        with self._lock:
            if trailer is not None:
                self._trailers.append(trailer)
            if error is not None and self.error is None:
                self.error = error
            self._remaining_lanes -= 1
            if self._remaining_lanes == 0:
                self.finished_at = time.monotonic()
                self._finished.set()


class KVRankReceiver:
    """The receiving half of one decode rank. `num_kv_heads` is the model's total KV heads."""

    def __init__(
        self, cache: KVCache, host: ChannelHost, decode_rank: int, num_kv_heads: int
    ) -> None:
        self.cache = cache
        self.host = host
        self.decode_rank = decode_rank
        self.num_kv_heads = num_kv_heads
        self.staging = StagingPool()

    @property
    def endpoint(self) -> ChannelEndpoint:
        return self.host.endpoint

    def receive(self, ticket: KVTicket) -> RecvHandle:
        """Start receiving `ticket`'s KV into `ticket.block_ids` of this rank's cache."""
        deadline = time.monotonic() + ticket.wait_to_start_s  # to the first message; see _Lane
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
            channel = self.host.accept(pair_key, str(ticket.transfer_id), deadline)
            view = WireView.for_ticket(self.cache, ticket.block_ids, segment.dst_heads, ticket)
            # On a channel that is up, post the receives here: the sender's first message then
            # finds them (gloo sends only once the receive is announced), instead of waiting for
            # this lane's thread to start.
            lane = _Lane(ticket, channel, view, deadline)
            if channel.ready:
                lane.post_early(self.staging)
            threading.Thread(
                target=self._run_lane,
                args=(handle, lane),
                name=f"kv-recv-{ticket.request_id}-{segment.prefill_rank}",
                daemon=True,
            ).start()
        return handle

    def _run_lane(self, handle: RecvHandle, lane: _Lane) -> None:
        try:
            trailer = lane.finish(self.staging)
            handle._lane_finished(trailer, None)
        except KVTransferError as exc:
            handle._lane_finished(None, exc)
        except Exception as exc:  # a bug or a shape mismatch: still end the handle, never hang
            lane.channel.mark_broken()
            handle._lane_finished(None, KVTransferError(f"{lane.channel}: {exc!r}"))
        finally:
            self.host.forget_transfer(lane.channel.pair_key, str(handle.ticket.transfer_id))

    def close(self) -> None:
        self.host.close()


class _Lane:
    """One channel's part of a receive: `post` the receives (once the channel is up), then
    `finish` on the lane's thread: wait for each message, scatter it, check the trailer."""

    def __init__(self, ticket: KVTicket, channel: Channel, view: WireView, deadline: float) -> None:
        self.ticket = ticket
        self.channel = channel
        self.view = view
        self.deadline = deadline
        self.what = f"request {ticket.request_id} (transfer {ticket.transfer_id})"
        self._posted: list[tuple[Any, torch.Tensor, bool]] | None = None
        self._header: tuple[Any, torch.Tensor] | None = None
        self._trailer: tuple[Any, torch.Tensor] | None = None
        self._early_error: Exception | None = None

    def post_early(self, staging: StagingPool) -> None:
        """`post` on the caller's thread; a failure is kept for `finish` to raise on the lane's
        thread, so `receive` itself never raises for a channel that broke."""
        try:
            self.post(staging)
        except Exception as exc:  # the channel broke between the check and the post
            self._early_error = exc

    def post(self, staging: StagingPool) -> None:
        """Post every receive of this lane at once (one message in whole mode)."""
        tid, view, channel = self.ticket.transfer_id, self.view, self.channel
        if not view.layerwise:
            message = view.packed_buffer(staging)
            self._posted = [(channel.irecv(message, view.tag(tid, 0)), message, True)]
            return
        header = empty_control(view.cache.device)
        self._header = (channel.irecv(header, view.tag(tid, 0)), header)
        posted = []
        for index in range(view.num_payload_messages):
            buffer, staged = view.incoming(index, staging)
            posted.append((channel.irecv(buffer, view.tag(tid, 1 + index)), buffer, staged))
        self._posted = posted
        trailer = empty_control(view.cache.device)
        last = 1 + view.num_payload_messages
        self._trailer = (channel.irecv(trailer, view.tag(tid, last)), trailer)

    def finish(self, staging: StagingPool) -> Trailer:
        """Wait for the data (bounded by the deadline); returns the trailer."""
        if self._early_error is not None:
            self.channel.mark_broken()
            raise KVTransferError(
                f"{self.channel}: posting the receives failed: {self._early_error}"
            )
        if self._posted is None:
            self.channel.wait_connected(self.deadline)
            self.post(staging)
        assert self._posted is not None
        if not self.view.layerwise:
            return self._finish_packed(staging)
        return self._finish_layerwise(staging)

    def _finish_layerwise(self, staging: StagingPool) -> Trailer:
        assert self._header is not None and self._trailer is not None and self._posted
        channel, view, what, tid = self.channel, self.view, self.what, self.ticket.transfer_id
        header_work, header = self._header
        channel.wait(header_work, self.deadline, f"{what} header")
        # The send has started: the rest must follow within the transfer timeout.
        self.deadline = min(self.deadline, time.monotonic() + self.ticket.timeout_s)
        try:
            status = view.check_header(header, tid, what)
        except KVTransferError:
            channel.mark_broken()  # the sender's other messages are still queued on it
            raise
        if status == STATUS_CANCELLED:
            # The payload receives stay posted and would never complete: dropping the channel
            # is the only way to be sure nothing lands in these blocks after they are freed.
            channel.mark_broken()
            raise KVTransferCancelled(f"{what}: the prefill side cancelled before sending")
        # Scatter message i while later messages are still arriving.
        for index, (work, buffer, staged) in enumerate(self._posted):
            channel.wait(work, self.deadline, f"{what} payload {index}")
            if staged:
                view.scatter(index, buffer)
                staging.give(buffer)
        trailer_work, trailer = self._trailer
        channel.wait(trailer_work, self.deadline, f"{what} trailer")
        magic, trailer_tid, status, first_token_id, num_tokens, sent_at_us = trailer.tolist()
        if magic != MAGIC or trailer_tid != tid:
            channel.mark_broken()
            raise KVTransferError(f"{what}: bad trailer {trailer.tolist()}")
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled mid-transfer")
        return Trailer(int(first_token_id), int(num_tokens), int(sent_at_us))

    def _finish_packed(self, staging: StagingPool) -> Trailer:
        """Whole mode: one message holds header, KV and trailer."""
        assert self._posted is not None
        ((work, message, _),) = self._posted
        self.channel.wait(work, self.deadline, self.what)
        try:
            status, trailer = self.view.unpack(message, self.ticket.transfer_id, self.what)
        except KVTransferError:
            self.channel.mark_broken()  # the two sides disagree: trust nothing on this channel
            raise
        staging.give(message)
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{self.what}: the prefill side cancelled")
        return trailer
