"""One prefill TP rank's share of the KV hand-off: send this rank's KV heads to the decode ranks.

Built on every rank by the Executor (inside worker/instance.KVRankSides, the rank extension) and
driven from the driver with `executor.run_on_ranks(command)`, in step order with the batches, so
every rank starts the same sends:

    driver                          every rank (PrefillRank)
    StartSend(ticket, blocks, t)    a thread: dial, post every message, wait (deadline)
    CancelSend(ticket)              a thread: dial, send a CANCELLED header only
    PollSends()                     reports of sends that ended, gathered to the driver

Each send runs on a thread of its own because dialing a channel blocks until the decode rank
joins (up to the ticket's deadline when it is gone); the step loop must never wait on a peer.
Sends to the same decode instance dial and post one at a time: a second dial of a channel that
is still connecting would use it half-built (ChannelDialer hands it out before it is connected).
Whole-request mode: the KV is final when the prompt's last chunk has run, so every message is
posted at once (layerwise tickets just post 2 messages per layer).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine import parallel
from engine.model_runner import ModelRunner
from engine.rank_device import device_thread
from engine.ranks import RankCommand
from kv_transfer.errors import KVTransferCancelled
from kv_transfer.messages import KVTicket
from kv_transfer.rank_sender import KVRankSender
from kv_transfer.rendezvous import ChannelDialer


@dataclass(frozen=True)
class SendReport:
    """One rank's send (or cancel) ended; `error` is None when every message was delivered."""

    request_id: str
    transfer_id: int
    rank: int
    cancel: bool
    error: str | None
    # (pair key, transport) of every pair this rank has sent to (KVRankSender.links)
    links: tuple[tuple[str, str], ...] = ()


class PrefillRank:
    """A rank's KVRankSender over its runner's KV cache, and the sends in flight on it."""

    def __init__(self, runner: ModelRunner, transport: str = "auto") -> None:
        self.rank = parallel.tp_rank()
        self.device = runner.device
        self.dialer = ChannelDialer(runner.device)
        self.sender = KVRankSender(
            runner.kv_cache,
            self.dialer,
            self.rank,
            runner.model_config.num_kv_heads,
            export_now=transport != "network",  # before serving: see KVRankSender
        )
        self._lock = threading.Lock()
        self._ended: list[SendReport] = []
        self._dial_locks: dict[str, threading.Lock] = {}  # per decode instance

    def start_send(self, ticket: KVTicket, block_ids: Sequence[int], first_token_id: int) -> None:
        """Send the KV in `block_ids` (kept referenced by the driver's KVSender until acked)."""
        self._spawn(ticket, lambda: self._send(ticket, block_ids, first_token_id), cancel=False)

    def cancel_send(self, ticket: KVTicket) -> None:
        """Tell the decode ranks that this transfer will never come (they free the blocks)."""
        self._spawn(ticket, lambda: self._cancel(ticket), cancel=True)

    def poll_sends(self) -> list[SendReport]:
        """Every rank's sends that ended since the last poll (a collective: every rank calls it)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return [report for reports in parallel.tp_all_gather_object(ended) for report in reports]

    def close(self) -> None:
        self.dialer.close()

    # ----------------------------------------------------------------- threads
    def _spawn(self, ticket: KVTicket, run: Callable[[], None], cancel: bool) -> None:
        def target() -> None:
            error: str | None = None
            try:
                run()
            except Exception as exc:  # every end is reported, whatever went wrong
                error = f"{type(exc).__name__}: {exc}"
            links = tuple(sorted(self.sender.links().items()))
            report = SendReport(
                ticket.request_id, ticket.transfer_id, self.rank, cancel, error, links
            )
            with self._lock:
                self._ended.append(report)

        name = f"kv-{'cancel' if cancel else 'send'}-{ticket.request_id}"
        device_thread(self.device, target, name).start()  # dials and copies touch the GPU

    def _dial_lock(self, ticket: KVTicket) -> threading.Lock:
        with self._lock:
            return self._dial_locks.setdefault(ticket.decode_instance_id, threading.Lock())

    def _send(self, ticket: KVTicket, block_ids: Sequence[int], first_token_id: int) -> None:
        with self._dial_lock(ticket):  # dialing and posting only; the waits overlap
            handle = self.sender.start(ticket, block_ids)
            handle.finish(first_token_id)
        handle.wait(timeout=None)  # every wait inside is bounded by the ticket's deadline

    def _cancel(self, ticket: KVTicket) -> None:
        with self._dial_lock(ticket):
            handle = self.sender.cancel_unstarted(ticket)
        with contextlib.suppress(KVTransferCancelled):  # the expected end
            handle.wait(timeout=None)


class SendingRanks(Protocol):
    """A rank extension with a sending side (worker/instance.KVRankSides)."""

    @property
    def sending(self) -> PrefillRank: ...


@dataclass(frozen=True)
class StartSend(RankCommand[SendingRanks, None]):
    ticket: KVTicket
    block_ids: tuple[int, ...]
    first_token_id: int

    def run(self, extension: SendingRanks) -> None:
        extension.sending.start_send(self.ticket, self.block_ids, self.first_token_id)


@dataclass(frozen=True)
class CancelSend(RankCommand[SendingRanks, None]):
    ticket: KVTicket

    def run(self, extension: SendingRanks) -> None:
        extension.sending.cancel_send(self.ticket)


@dataclass(frozen=True)
class PollSends(RankCommand[SendingRanks, "list[SendReport]"]):
    def run(self, extension: SendingRanks) -> list[SendReport]:
        return extension.sending.poll_sends()
