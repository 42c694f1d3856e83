"""One transfer on one prefill rank: its lanes (one per decode rank it sends to), their
messages in order, and the waits. KVRankSender (rank_sender.py) dials the lanes and builds it;
see that module for the whole flow and why messages are posted from a thread on CPU.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.channel import Channel, ChannelEndpoint
from kv_transfer.errors import KVTransferError, KVTransferTimeout
from kv_transfer.messages import KVTicket
from kv_transfer.posters import POSTERS
from kv_transfer.receiver import RANK_REPORT_GRACE_S
from kv_transfer.rendezvous import ChannelDialer
from kv_transfer.same_node import ACK_WRITE, copy_blocks, end_message
from kv_transfer.staging import StagingPool
from kv_transfer.streams import Outgoing
from kv_transfer.wire import (
    MAGIC,
    STATUS_CANCELLED,
    STATUS_OK,
    WireView,
    control_message,
    empty_control,
)


@dataclass
class SendLane:
    """One channel's part of a transfer; `next_index` counts payload messages posted."""

    endpoint: ChannelEndpoint
    view: WireView
    channel: Channel | None = None
    next_index: int = 0
    # Its place in the channel's ordered stream: its messages, posted ones with the tensors they
    # read (a tensor must outlive its send) and whether each is a staging buffer to give back.
    outgoing: Outgoing | None = None
    same_node: bool = False  # the decode rank copies the KV itself (same_node.py)
    dst_heads: slice = field(default_factory=lambda: slice(0, 0))  # the decode rank's heads
    # Same-node split (same_node.py): the leading blocks this side writes itself once the decode
    # side acks, the ack's buffer, and when this side stops starting copies (the ack says).
    split: int = 0
    ack: torch.Tensor | None = None
    write_by_ns: int = 0
    written: int = 0  # how many of them it wrote


_WAIT_ALL = None  # the poster's last item: every message is posted, wait for them
# The same-node split (same_node.py): from this many bytes a lane, the prefill side copies the
# first half of the blocks itself (smaller ones: the ack's round trip costs more than it saves),
# this much between two looks at the write-by the decode side's ack named.
_SPLIT_MIN_BYTES = 4 << 20
SPLIT_MIN_BYTES_ENV = "PDSERVE_SAME_NODE_SPLIT_MIN_BYTES"  # overrides it (tests: tiny models)
_SPLIT_CHUNK_BYTES = 16 << 20


class SendHandle:
    """One transfer on one prefill rank."""

    def __init__(
        self,
        ticket: KVTicket,
        lanes: list[SendLane],
        dialer: ChannelDialer,
        staging: StagingPool,
        post_inline: bool,
    ) -> None:
        self.ticket = ticket
        self._staging = staging
        self.deadline = time.monotonic() + ticket.timeout_s
        # A split same-node lane's waits: its ack and report may come a grace past the deadline
        self._split_deadline = self.deadline + RANK_REPORT_GRACE_S / 2
        self._lanes = lanes
        self._dialer = dialer
        self._finished = threading.Event()
        self._finishing = False
        self.error: KVTransferError | None = None
        self._post_inline = post_inline
        self._outbox: queue.SimpleQueue[
            tuple[SendLane, torch.Tensor, int, str, bool, bool, bool, torch.Tensor | None] | None
        ]
        self._outbox = queue.SimpleQueue()
        POSTERS.run(self._poster, lanes[0].view.cache.device if lanes else None)

    def _what(self, lane: SendLane) -> str:
        return f"request {self.ticket.request_id} (transfer {self.ticket.transfer_id}) to {lane.channel}"

    def _fail(self, lane: SendLane, exc: KVTransferError) -> None:
        channel, lane.channel = lane.channel, None  # nothing more goes on this lane
        outgoing = lane.outgoing
        if channel is not None:
            if outgoing is not None and not outgoing.started and outgoing.error is None:
                # Nothing of it is on the wire: a CANCELLED header takes its place in the
                # stream, so the decode side ends it promptly and the channel stays.
                header = lane.view.header(self.ticket.transfer_id, STATUS_CANCELLED)
                channel.sends.abandon(outgoing, header)
            else:
                channel.mark_broken()
                self._dialer.report_broken(lane.endpoint, channel)
        if self.error is None:
            self.error = exc

    def _post(
        self,
        lane: SendLane,
        tensor: torch.Tensor,
        index: int,
        what: str,
        staged: bool = False,
        last: bool = False,
        control: bool = False,
        reply: torch.Tensor | None = None,
    ) -> None:
        """Queue one message of the lane's transfer. `control`: a header or trailer (a CPU
        tensor), which goes on the channel's control group, never the KV's (channel.py).
        `reply`: a control message's buffer to receive the peer's answer into (streams.py)."""
        if self._post_inline:
            self._post_now(lane, tensor, index, what, staged, last, control, reply)
        else:
            self._outbox.put((lane, tensor, index, what, staged, last, control, reply))

    def _post_now(
        self,
        lane: SendLane,
        tensor: torch.Tensor,
        index: int,
        what: str,
        staged: bool,
        last: bool,
        control: bool,
        reply: torch.Tensor | None = None,
    ) -> None:
        channel, outgoing = lane.channel, lane.outgoing  # read once: the lane may fail meanwhile
        if channel is None or outgoing is None:
            return
        tag = lane.view.tag(self.ticket.transfer_id, index)
        channel.sends.push(outgoing, tensor, tag, what, staged, last, control, reply)

    def _post_payload_until(self, lane: SendLane, stop: int) -> None:
        while lane.next_index < stop:
            index = lane.next_index
            lane.next_index += 1
            if lane.channel is None:
                continue  # the lane failed: nothing to send it on
            tensor, staged = lane.view.outgoing(index, self._staging)
            self._post(lane, tensor, 1 + index, f"payload {index}", staged)

    def send_layer(self, layer: int) -> None:
        """Post layer `layer`'s keys and values on every channel (a no-op for whole-request
        tickets, so the model runner calls it regardless). Layers must come in order; the KV of
        `layer` must be final when this is called."""
        if not self.ticket.layerwise:
            return  # whole-request wire mode: everything goes at finish()
        for lane in self._lanes:
            if lane.same_node:
                continue  # the decode side copies every layer once the trailer says so
            per_layer = lane.view.messages_per_layer
            if lane.next_index != layer * per_layer:
                raise ValueError(
                    f"send_layer({layer}) out of order: expected {lane.next_index // per_layer}"
                )
            self._post_payload_until(lane, (layer + 1) * per_layer)

    def finish(self, first_token_id: int | None = None) -> None:
        """Post what is left and the trailers, then wait for every send in a background thread."""
        self._finish(STATUS_OK, first_token_id)

    def cancel(self) -> None:
        """End the transfer early but cleanly: the decode side sees CANCELLED and frees its blocks.

        The payload still to go is sent anyway (the decode side has posted its receives for it),
        so both sides finish at once instead of at the deadline.
        """
        self._finish(STATUS_CANCELLED, None)

    def _finish(self, status: int, first_token_id: int | None) -> None:
        if self._finishing:
            return
        self._finishing = True
        sent_at_us = int(time.time() * 1e6)  # the first token's time, for the decode side's TPOT
        if status == STATUS_OK and any(lane.same_node for lane in self._lanes):
            cache = self._lanes[0].view.cache
            if cache.device.type == "cuda":  # the KV is written before the decode side reads it
                torch.cuda.current_stream(cache.device).synchronize()
        for lane in self._lanes:
            if lane.same_node:
                self._post_same_node_end(lane, status, first_token_id, sent_at_us)
                continue
            if not lane.view.layerwise:
                self._post_packed(lane, status, first_token_id, sent_at_us)
                continue
            self._post_payload_until(lane, lane.view.num_payload_messages)
            values = (
                self.ticket.transfer_id,
                status,
                -1 if first_token_id is None else first_token_id,
                self.ticket.num_tokens,
                sent_at_us,
            )
            trailer = control_message(values, torch.device("cpu"))  # control: gloo
            last = 1 + lane.view.num_payload_messages
            self._post(lane, trailer, last, "trailer", last=True, control=True)
        if status == STATUS_CANCELLED and self.error is None:
            self.error = KVTransferError(f"request {self.ticket.request_id}: cancelled")
        self._start_waiting()

    def _start_waiting(self) -> None:
        """After the last post: wait for every send (on the poster, after what it still holds)."""
        self._outbox.put(_WAIT_ALL)

    def _poster(self) -> None:
        """Post queued messages in order (none when posting inline); then wait for all of them.
        A handle that is never finished (its owner died) still ends here at the deadline,
        failing its lanes."""
        try:
            while True:
                try:
                    item = self._outbox.get(timeout=max(0.0, self.deadline - time.monotonic()))
                except queue.Empty:
                    self._fail_all(KVTransferTimeout("not finished within the deadline"))
                    return
                if item is _WAIT_ALL:
                    self._split_writes()
                    self._wait_all()
                    return
                self._post_now(*item)
        except Exception as exc:  # a bug must still end the handle, never leave it hanging
            self._fail_all(KVTransferError(f"the send thread failed: {exc!r}"))
        finally:
            self._finished.set()

    def _fail_all(self, exc: KVTransferError) -> None:
        """End the transfer as failed: every lane (even one still dialing) and the handle."""
        for lane in self._lanes:
            self._fail(lane, type(exc)(f"{self._what(lane)}: {exc}"))
        if self.error is None:
            self.error = exc

    def _post_packed(
        self, lane: SendLane, status: int, first_token_id: int | None, sent_at_us: int = 0
    ) -> None:
        if lane.channel is None:
            return
        tid = self.ticket.transfer_id
        header = lane.view.header(tid, status)
        if status == STATUS_CANCELLED:  # the header alone: nothing follows it
            self._post(lane, header, 0, "header", last=True, control=True)
            return
        self._post(lane, header, 0, "header", control=True)
        first = -1 if first_token_id is None else first_token_id
        message = lane.view.pack(
            self._staging,
            self.ticket.transfer_id,
            status,
            first,
            self.ticket.num_tokens,
            sent_at_us,
        )
        self._post(lane, message, 1, "packed KV", staged=True, last=True)

    def _post_same_node_end(
        self, lane: SendLane, status: int, first_token_id: int | None, sent_at_us: int
    ) -> None:
        """The same-node transport's M1 (same_node.end_message): header, trailer, until when the
        source blocks are held (this handle's deadline; the instance frees them a grace period
        after it), the split and the source block ids. With a split, the ack's receive goes
        right behind M1, and the poster thread writes the first blocks and posts M2."""
        tid = self.ticket.transfer_id
        first = -1 if first_token_id is None else first_token_id
        trailer = control_message(
            (tid, status, first, self.ticket.num_tokens, sent_at_us), torch.device("cpu")
        )
        copy_by_ns = int(self.deadline * 1e9)  # CLOCK_MONOTONIC: one clock on one node
        channel, view = lane.channel, lane.view
        if (
            status == STATUS_OK
            and channel is not None
            and channel.dest is not None
            and view.cache.device.type == "cpu"
            and view.payload_bytes >= int(os.environ.get(SPLIT_MIN_BYTES_ENV) or _SPLIT_MIN_BYTES)
            and len(view.block_ids) >= 2  # a share for each side
        ):
            lane.split = len(view.block_ids) // 2
            lane.ack = empty_control(torch.device("cpu"))
        message = end_message(
            view.header(tid, status), trailer, copy_by_ns, view.block_ids, lane.split
        )
        self._post(
            lane,
            message,
            0,
            "same-node message",
            last=not lane.split,
            control=True,
            reply=lane.ack,
        )

    def _split_writes(self) -> None:
        """For each split lane: wait for the decode side's ack, write the first `split` blocks
        into its cache (starting none past the write-by the ack names), then post M2 with how
        many it wrote. The waits run a grace past the deadline: the decode side still copies
        then, and a late one answers ACK_LATE, which keeps the stream (and channel) whole."""
        tid = self.ticket.transfer_id
        for lane in self._lanes:
            channel, outgoing, ack = lane.channel, lane.outgoing, lane.ack
            if not lane.split or channel is None or outgoing is None or ack is None:
                continue
            try:
                reply = outgoing.wait_reply(self._split_deadline)
                channel.wait(reply, self._split_deadline, "ack")
            except KVTransferError as exc:
                self._fail(lane, exc)
                continue
            magic, ack_tid, status, lane.write_by_ns = ack.tolist()[:4]
            if magic != MAGIC or ack_tid != tid:
                self._fail(lane, KVTransferError(f"{self._what(lane)}: bad ack {ack.tolist()}"))
                continue
            done = self._write_split(lane, channel) if status == ACK_WRITE else 0
            lane.written = done
            report = control_message((tid, STATUS_OK, done, 0, 0), torch.device("cpu"))
            self._post_now(lane, report, 1, "copy report", False, True, True)

    def _write_split(self, lane: SendLane, channel: Channel) -> int:
        """Copy blocks [0, split) into the decode rank's cache, in order, a chunk at a time,
        starting none past write-by; how many were written."""
        dest = channel.mapped_dest()
        if dest is None:
            return 0
        view, dst_ids = lane.view, self.ticket.block_ids
        chunk = max(1, _SPLIT_CHUNK_BYTES * len(view.block_ids) // max(1, view.payload_bytes))
        done = 0
        while done < lane.split and time.monotonic_ns() < lane.write_by_ns:
            end = min(lane.split, done + chunk)
            try:
                copy_blocks(
                    view.cache.data,
                    view.heads,
                    view.block_ids[done:end],
                    dest,
                    lane.dst_heads,
                    dst_ids[done:end],
                )
            except Exception:  # a mismatch: the decode side's copy of the rest reports it
                break
            done = end
        return done

    def _wait_all(self) -> None:
        try:
            for lane in self._lanes:
                outgoing = lane.outgoing
                if lane.channel is None or outgoing is None:
                    continue
                # Transfers opened earlier on the channel go first (one ordered stream).
                deadline = self._split_deadline if lane.split else self.deadline
                remaining = max(0.0, deadline - time.monotonic())
                if not outgoing.all_posted.wait(remaining):
                    message = "still queued behind earlier transfers at the deadline"
                    self._fail(lane, KVTransferTimeout(f"{self._what(lane)}: {message}"))
                    continue
                if outgoing.error is not None:
                    self._fail(lane, outgoing.error)
                    continue
                for work, tensor, what, staged in outgoing.posted:
                    if lane.channel is None:
                        break
                    try:
                        lane.channel.wait(work, deadline, f"{self._what(lane)} {what}")
                    except KVTransferError as exc:
                        self._fail(lane, exc)
                    else:
                        if staged:  # sent: the backend no longer reads it
                            self._staging.give(tensor)
                outgoing.posted.clear()
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def blocks_written(self) -> list[int]:
        """Per lane, how many blocks this side wrote into the decode rank's cache itself (the
        same-node split; 0 where the decode side copied them all)."""
        return [lane.written for lane in self._lanes]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every send finished; raises the first KVTransferError (or cancellation).
        A handle that is never finished ends at its deadline, failed."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.ticket.request_id}: send still in flight")
        if self.error is not None:
            raise self.error
