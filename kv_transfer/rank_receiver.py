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

from engine.kv_cache import KVCache, local_kv_heads
from kv_transfer.channel import Channel, ChannelEndpoint, ChannelHost
from kv_transfer.errors import KVTransferCancelled, KVTransferError
from kv_transfer.messages import KVTicket
from kv_transfer.plan import PlanSegment, plan_transfer
from kv_transfer.staging import StagingPool
from kv_transfer.wire import MAGIC, STATUS_CANCELLED, WireView, empty_control


@dataclass(frozen=True)
class ReceivedKV:
    """What landed: the metadata the prefill side sent after the KV."""

    request_id: str
    transfer_id: int
    first_token_id: int | None
    num_tokens: int


class RecvHandle:
    """One transfer on one decode rank. `wait` returns the ReceivedKV or raises KVTransferError."""

    def __init__(self, ticket: KVTicket, num_lanes: int) -> None:
        self.ticket = ticket
        self._remaining_lanes = num_lanes
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._trailers: list[tuple[int, int]] = []  # (first_token_id, num_tokens) per lane
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
        first_token_id = self._trailers[0][0] if self._trailers else -1
        return ReceivedKV(
            self.ticket.request_id,
            self.ticket.transfer_id,
            None if first_token_id < 0 else first_token_id,
            self.ticket.num_tokens,
        )

    def _lane_finished(
        self, trailer: tuple[int, int] | None, error: KVTransferError | None
    ) -> None:
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
        deadline = time.monotonic() + ticket.timeout_s
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
            view = WireView(self.cache, ticket.block_ids, segment.dst_heads, ticket.layerwise)
            threading.Thread(
                target=self._run_lane,
                args=(handle, channel, view, segment, deadline),
                name=f"kv-recv-{ticket.request_id}-{segment.prefill_rank}",
                daemon=True,
            ).start()
        return handle

    def _run_lane(
        self,
        handle: RecvHandle,
        channel: Channel,
        view: WireView,
        segment: PlanSegment,
        deadline: float,
    ) -> None:
        ticket = handle.ticket
        try:
            trailer = self._receive_lane(ticket, channel, view, deadline)
            handle._lane_finished(trailer, None)
        except KVTransferError as exc:
            handle._lane_finished(None, exc)
        except Exception as exc:  # a bug or a shape mismatch: still end the handle, never hang
            channel.mark_broken()
            handle._lane_finished(None, KVTransferError(f"{channel}: {exc!r}"))
        finally:
            self.host.forget_transfer(channel.pair_key, str(ticket.transfer_id))

    def _receive_lane(
        self, ticket: KVTicket, channel: Channel, view: WireView, deadline: float
    ) -> tuple[int, int]:
        what = f"request {ticket.request_id} (transfer {ticket.transfer_id})"
        tid = ticket.transfer_id
        channel.wait_connected(deadline)
        if not view.layerwise:
            return self._receive_packed(ticket, channel, view, deadline)
        # Post everything at once: one round trip fewer than waiting for the header first.
        header = empty_control(self.cache.device)
        header_work = channel.irecv(header, view.tag(tid, 0))
        posted = []
        for index in range(view.num_payload_messages):
            buffer, staged = view.incoming(index, self.staging)
            posted.append((channel.irecv(buffer, view.tag(tid, 1 + index)), buffer, staged))
        trailer = empty_control(self.cache.device)
        trailer_work = channel.irecv(trailer, view.tag(tid, 1 + view.num_payload_messages))
        channel.wait(header_work, deadline, f"{what} header")
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
        for index, (work, buffer, staged) in enumerate(posted):
            channel.wait(work, deadline, f"{what} payload {index}")
            if staged:
                view.scatter(index, buffer)
                self.staging.give(buffer)
        channel.wait(trailer_work, deadline, f"{what} trailer")
        magic, trailer_tid, status, first_token_id, num_tokens, _ = trailer.tolist()
        if magic != MAGIC or trailer_tid != tid:
            channel.mark_broken()
            raise KVTransferError(f"{what}: bad trailer {trailer.tolist()}")
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled mid-transfer")
        return int(first_token_id), int(num_tokens)

    def _receive_packed(
        self, ticket: KVTicket, channel: Channel, view: WireView, deadline: float
    ) -> tuple[int, int]:
        """Whole mode: one message holds header, KV and trailer."""
        what = f"request {ticket.request_id} (transfer {ticket.transfer_id})"
        message = view.packed_buffer(self.staging)
        channel.wait(channel.irecv(message, view.tag(ticket.transfer_id, 0)), deadline, what)
        try:
            status, first_token_id, num_tokens = view.unpack(message, ticket.transfer_id, what)
        except KVTransferError:
            channel.mark_broken()  # the two sides disagree: trust nothing on this channel
            raise
        self.staging.give(message)
        if status == STATUS_CANCELLED:
            raise KVTransferCancelled(f"{what}: the prefill side cancelled")
        return first_token_id, num_tokens

    def close(self) -> None:
        self.host.close()
