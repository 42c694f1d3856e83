"""One decode TP rank's share of the KV hand-off: receive this rank's KV heads into its cache.

Built on every rank by the Executor (inside worker/instance.KVRankSides, the rank extension) and
driven from the driver with `executor.run_on_ranks(command)`, in step order:

    driver                 every rank (DecodeRank)
    Endpoints()            every rank's ChannelEndpoint, gathered
    StartReceive(ticket)   KVRankReceiver.receive: returns at once; threads wait for the data
                           (bounded by the deadline)
    PollReceives()         reports of receives that ended, gathered

The ticket's blocks stay reserved in the driver's KVReceiver until every rank has reported:
until then the backend may still write into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine import parallel
from engine.model_runner import ModelRunner
from engine.ranks import RankCommand
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.errors import KVTransferCancelled, KVTransferError
from kv_transfer.messages import KVTicket
from kv_transfer.rank_receiver import KVRankReceiver, RecvHandle
from kv_transfer.rendezvous import ChannelHost


@dataclass(frozen=True)
class RecvReport:
    """One rank's receive ended; `error` None means the KV landed (with the first token)."""

    request_id: str
    transfer_id: int
    rank: int
    first_token_id: int | None
    error: str | None
    cancelled: bool = False  # the prefill side ended the transfer on purpose
    first_token_at: float | None = None  # the prefill side's time.time() at the first token


class DecodeRank:
    """A rank's KVRankReceiver over its runner's KV cache, and the receives in flight on it."""

    def __init__(
        self, runner: ModelRunner, host: str = "127.0.0.1", transport: str = "auto"
    ) -> None:
        self.rank = parallel.tp_rank()
        self.channel_host = ChannelHost(runner.device, host)
        self.receiver = KVRankReceiver(
            runner.kv_cache,
            self.channel_host,
            self.rank,
            runner.model_config.num_kv_heads,
            export_now=transport != "network",  # before serving: see KVRankReceiver
        )
        self._handles: list[RecvHandle] = []

    def endpoints(self) -> list[ChannelEndpoint]:
        """Every rank's endpoint, in rank order (a collective)."""
        return parallel.tp_all_gather_object(self.channel_host.endpoint)

    def start_receive(self, ticket: KVTicket) -> None:
        """Post the receive (a collective: it returns once every rank has posted, so the ticket
        leaves only when every rank's channel host expects the transfer)."""
        self._handles.append(self.receiver.receive(ticket))
        parallel.tp_all_gather_object(None)

    def poll_receives(self) -> list[RecvReport]:
        """Every rank's receives that ended since the last poll (a collective)."""
        ended: list[RecvHandle] = []
        receiving: list[RecvHandle] = []
        for handle in self._handles:  # done() is checked once: it may turn True meanwhile
            (ended if handle.done() else receiving).append(handle)
        self._handles = receiving
        reports = parallel.tp_all_gather_object([self._report(handle) for handle in ended])
        return [report for rank_reports in reports for report in rank_reports]

    def _report(self, handle: RecvHandle) -> RecvReport:
        ticket = handle.ticket
        first_token_id = first_token_at = error = None
        cancelled = False
        try:
            received = handle.wait(0)
            first_token_id, first_token_at = received.first_token_id, received.first_token_at
        except KVTransferError as exc:
            error, cancelled = str(exc), isinstance(exc, KVTransferCancelled)
        return RecvReport(
            ticket.request_id,
            ticket.transfer_id,
            self.rank,
            first_token_id,
            error,
            cancelled,
            first_token_at,
        )

    def close(self) -> None:
        self.channel_host.close()


class ReceivingRanks(Protocol):
    """A rank extension with a receiving side (worker/instance.KVRankSides)."""

    @property
    def receiving(self) -> DecodeRank: ...


@dataclass(frozen=True)
class Endpoints(RankCommand[ReceivingRanks, "list[ChannelEndpoint]"]):
    def run(self, extension: ReceivingRanks) -> list[ChannelEndpoint]:
        return extension.receiving.endpoints()


@dataclass(frozen=True)
class StartReceive(RankCommand[ReceivingRanks, None]):
    ticket: KVTicket

    def run(self, extension: ReceivingRanks) -> None:
        extension.receiving.start_receive(self.ticket)


@dataclass(frozen=True)
class PollReceives(RankCommand[ReceivingRanks, "list[RecvReport]"]):
    def run(self, extension: ReceivingRanks) -> list[RecvReport]:
        return extension.receiving.poll_receives()
