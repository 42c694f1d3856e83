"""One ordered stream of transfers per channel direction, so matching by order is always right.

NCCL ignores tags: between two ranks, the n-th send matches the n-th receive. So a channel must
never carry two transfers' messages interleaved, and the receiving side must never post a
transfer's payload receives before it knows which transfer comes next. Each channel carries:

    header (int64[6], names the transfer) [payload ... trailer]   header [payload ...] ...
    (same-node channels: one message per transfer, header first, or two when the prefill side
    copies part of the KV itself, with the decode side's ack between them; see same_node.py)

    prefill (SendStream)                          decode (RecvStream, one reader thread)
    open(transfer) in dial order                  expect(transfer) when the ticket is made
    push(message) ... push(last message)          one header receive is always posted
      only the oldest open transfer posts;        header arrives -> look up its transfer
      the next one's messages wait behind it        -> post ITS payload receives, in order
                                                    -> wait (bounded by the transfer's deadline)
                                                  -> post the next header receive

A transfer waiting for its header is withdrawn at its deadline without touching the channel
(the header receive stays posted for whichever transfer comes next). A failure while a transfer
owns the stream breaks the channel: the stream's position is unknown, so the channel is rebuilt
and every transfer still queued on it fails. A header naming no expected transfer (one that was
withdrawn) breaks it too: its payload sizes are unknown here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.rank_device import device_thread
from kv_transfer.errors import KVTransferCancelled, KVTransferError
from kv_transfer.wire import CONTROL_LEN, HEADER_TAG, MAGIC, empty_control

if TYPE_CHECKING:
    from kv_transfer.channel import Channel, Posted

# The header wait is a wait for new work: it has no deadline of its own (transfers that wait for
# their header are withdrawn at theirs). A channel whose peer dies ends it with an error.
_IDLE_WAIT_S = 7 * 24 * 3600.0


@dataclass(eq=False)
class Outgoing:
    """One transfer's messages on one channel, in order; `posted` holds what the backend has."""

    what: str
    # (tensor, tag, what, staged, control, reply): control messages go on the control group
    # (channel.py); `reply`, when set, is the buffer of a control receive posted right behind
    # the message, so replies are posted in the stream's order too (same_node.py's ack)
    pending: deque[tuple[torch.Tensor, int, str, bool, bool, torch.Tensor | None]] = field(
        default_factory=deque
    )
    posted: list[tuple[Posted, torch.Tensor, str, bool]] = field(default_factory=list)
    closed: bool = False  # the last message was pushed
    started: bool = False  # a message reached the backend: the stream now depends on the rest
    error: KVTransferError | None = None
    all_posted: threading.Event = field(default_factory=threading.Event)
    reply: Posted | None = None  # the receive posted for a message's reply
    replied: threading.Event = field(default_factory=threading.Event)  # reply posted, or error

    def fail(self, error: KVTransferError) -> None:
        self.error = self.error or error
        self.all_posted.set()
        self.replied.set()

    def wait_reply(self, deadline: float) -> Posted:
        """The reply's posted receive, once the message before it reached the backend."""
        if not self.replied.wait(max(0.0, deadline - time.monotonic())):
            raise KVTransferError(f"{self.what}: still queued behind earlier transfers")
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


class SendStream:
    """The prefill side of one channel: transfers post in the order they were opened, each
    whole before the next begins. Posting happens on the thread that pushes."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._order: deque[Outgoing] = deque()
        self._lock = threading.Lock()
        channel.on_broken(self._fail_queued)

    def open(self, what: str) -> Outgoing:
        outgoing = Outgoing(what)
        with self._lock:
            if self.channel.broken:
                outgoing.fail(KVTransferError(f"{self.channel} is broken"))
            else:
                self._order.append(outgoing)
        return outgoing

    def push(
        self,
        outgoing: Outgoing,
        tensor: torch.Tensor,
        tag: int,
        what: str,
        staged: bool,
        last: bool,
        control: bool = False,
        reply: torch.Tensor | None = None,
    ) -> None:
        with self._lock:
            if outgoing.error is not None or outgoing.closed:
                return
            outgoing.pending.append((tensor, tag, what, staged, control, reply))
            outgoing.closed = last
            broke = self._drain()
        if broke:
            self.channel.mark_broken()  # outside the lock: it fails what is queued here

    def abandon(self, outgoing: Outgoing, cancel_header: torch.Tensor) -> None:
        """The transfer ends early. Not yet begun: `cancel_header` (a CANCELLED header) goes
        in its place, alone, and the channel stays. Begun and not whole: the stream is torn,
        so the channel breaks."""
        with self._lock:
            if outgoing in self._order and not outgoing.started:
                outgoing.pending.clear()
                outgoing.pending.append(
                    (cancel_header, HEADER_TAG, "cancelled header", False, True, None)
                )
                outgoing.closed = True
                outgoing.error = KVTransferError(f"{outgoing.what}: abandoned")
                outgoing.replied.set()
                broke = self._drain()
            else:
                broke = outgoing in self._order  # begun and not whole: the stream is torn
        if broke:
            self.channel.mark_broken()

    def _drain(self) -> bool:
        """Post the oldest transfer's messages; move on once its last one is posted. True when
        the backend refused one: the caller breaks the channel."""
        while self._order:
            head = self._order[0]
            while head.pending:
                tensor, tag, what, staged, control, reply = head.pending.popleft()
                try:
                    work = self.channel.isend(tensor, tag, control)
                    if reply is not None:
                        head.reply = self.channel.irecv(reply, tag, control=True)
                except Exception as exc:  # the peer is gone or the group was dropped
                    head.fail(KVTransferError(f"{head.what}: posting {what} failed: {exc}"))
                    self._order.popleft()
                    return True
                head.started = True
                head.posted.append((work, tensor, what, staged))
                if reply is not None:
                    head.replied.set()
            if not head.closed:
                return False
            head.all_posted.set()
            self._order.popleft()
        return False

    def _fail_queued(self, error: KVTransferError) -> None:
        with self._lock:
            queued, self._order = self._order, deque()
        for outgoing in queued:
            outgoing.fail(KVTransferError(f"{outgoing.what}: {error}"))


class Incoming:
    """One transfer this channel will carry, as the decode side receives it. The reader calls
    `receive` once its header has arrived; `end` is called exactly once, by the reader or by
    the withdrawal at the deadline."""

    transfer_id: int
    deadline: float  # by when its header must arrive
    # How long the first receive must be on a same-node channel, where one message carries the
    # whole transfer (same_node.end_message): long enough for ANY transfer the channel may carry
    # (a longer message than the posted receive breaks gloo). A network channel's header is
    # CONTROL_LEN exactly.
    same_node_message_len: int = CONTROL_LEN

    def receive(
        self, channel: Channel, header: torch.Tensor, post_next: Callable[[], None]
    ) -> object:
        """Post this transfer's receives, call `post_next` once they are all posted (the next
        header's receive goes right behind them), then wait for them and return the result."""
        raise NotImplementedError

    def end(self, result: object, error: KVTransferError | None) -> None:
        raise NotImplementedError


class RecvStream:
    """The decode side of one channel: one reader thread receives transfers in arrival order."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._expected: dict[int, Incoming] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._ended: KVTransferError | None = None
        self._same_node_len = CONTROL_LEN  # the longest any expected transfer needs
        self._buffer: torch.Tensor | None = None  # same-node first-message buffers, in turn
        self._spare: torch.Tensor | None = None
        channel.on_broken(self._fail_expected)

    def expect(self, incoming: Incoming) -> None:
        with self._lock:
            ended = self._ended
            if ended is None:
                self._expected[incoming.transfer_id] = incoming
                self._same_node_len = max(self._same_node_len, incoming.same_node_message_len)
                if self._reader is None:
                    self._reader = device_thread(
                        self.channel.device, self._read, f"kv-read-{self.channel.pair_key}"
                    )
                    self._reader.start()
        if ended is not None:
            incoming.end(None, KVTransferError(f"{self.channel}: {ended}"))

    def withdraw(self, incoming: Incoming) -> bool:
        """Take back a transfer whose header has not arrived; False once the reader owns it."""
        with self._lock:
            return self._expected.pop(incoming.transfer_id, None) is incoming

    def _post_header(self) -> tuple[Posted, torch.Tensor]:
        """Post the receive of the next transfer's first message."""
        channel = self.channel
        if channel.same_node:  # gloo takes a shorter message into a longer receive
            with self._lock:
                length = self._same_node_len
            # Two buffers in turn: the next one is posted while this one is still being read.
            self._spare, header = self._buffer, self._spare
            if header is None or header.numel() != length:
                header = torch.zeros(length, dtype=torch.int64)
            self._buffer = header
        else:  # the header alone (a control message: CPU, on gloo even beside NCCL)
            header = empty_control(torch.device("cpu"))
        return channel.irecv(header, HEADER_TAG, control=True), header

    def _read(self) -> None:
        channel = self.channel
        try:
            channel.wait_connected(time.monotonic() + _IDLE_WAIT_S)
            posted: tuple[Posted, torch.Tensor] | None = self._post_header()
            while True:
                assert posted is not None
                work, header = posted
                channel.wait(work, time.monotonic() + _IDLE_WAIT_S, "the next header")
                magic, transfer_id = header[:2].tolist()
                with self._lock:
                    incoming = self._expected.pop(transfer_id, None)
                if magic != MAGIC or incoming is None:
                    raise KVTransferError(
                        f"{channel}: header {header.tolist()[:6]} names no transfer this side "
                        "expects"
                    )
                posted = None

                def post_next() -> None:
                    """The next header's receive, right behind this transfer's last one: a
                    transfer queued behind this one then finds it posted (gloo writes only
                    into a posted receive)."""
                    nonlocal posted
                    if posted is None:
                        posted = self._post_header()

                try:
                    result = incoming.receive(channel, header, post_next)
                except KVTransferCancelled as exc:  # the stream is still in step
                    post_next()
                    incoming.end(None, exc)
                    continue
                except KVTransferError as exc:
                    incoming.end(None, exc)
                    raise
                except Exception as exc:  # a bug or a shape mismatch: end it, never hang
                    incoming.end(None, KVTransferError(f"{channel}: {exc!r}"))
                    raise
                post_next()
                incoming.end(result, None)
        except Exception as exc:
            error = exc if isinstance(exc, KVTransferError) else KVTransferError(str(exc))
            channel.mark_broken()
            self._fail_expected(error)

    def _fail_expected(self, error: KVTransferError) -> None:
        with self._lock:
            self._ended = self._ended or error
            expected, self._expected = self._expected, {}
        for incoming in expected.values():
            incoming.end(None, KVTransferError(f"{self.channel}: {error}"))


def call_at(deadline: float, action: Callable[[], None]) -> threading.Timer:
    """Run `action` on a timer thread at `deadline` (time.monotonic)."""
    timer = threading.Timer(max(deadline - time.monotonic(), 0.0), action)
    timer.daemon = True
    timer.start()
    return timer
