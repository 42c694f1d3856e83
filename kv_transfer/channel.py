"""Point-to-point channels: one 2-rank process group per (prefill rank, decode rank) pair.

Each channel is its own process group built from its own store, never the default group, so a
worker's TP group and its channels coexist and one dead peer breaks one channel, not the cluster.
Gloo on CPU tensors, NCCL on CUDA tensors; the rest of kv_transfer does not know which.

Rendezvous. Every decode rank hosts one TCPStore (its `ChannelEndpoint`, carried in tickets);
prefill ranks join it as clients. A channel's group lives under the store prefix
`<pair_key>/<epoch>`. The decode side picks the epoch for each transfer and publishes it under the
transfer's key; the prefill side reads it and joins that epoch, so after a failure both sides
rebuild into the same fresh group (a gloo rendezvous must never reuse an old prefix):

    decode rank (host)                        prefill rank (dialer)
    accept(pair, transfer)                    dial(endpoint, pair, transfer)
      broken or absent -> epoch += 1            epoch = store.get(pair/t/transfer)
      store.set(pair/t/transfer, epoch)         no such key -> the receive is over: fail
      (before the ticket leaves)                epoch newer than mine -> rebuild
      connect in the background                 connect (joins the same prefix)

After any failed or timed-out wait the group's state is undefined (gloo closes the connection on a
timeout), so the channel is marked broken and rebuilt on next use; the dialer also records the
broken epoch in the store so that the host rebuilds even if its side never saw the failure.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from engine.net import create_store
from kv_transfer.errors import KVTransferError, KVTransferTimeout
from kv_transfer.streams import RecvStream, SendStream

_STORE_OP_TIMEOUT_S = 30.0
_DIAL_POLL_S = 0.002
# Tests set it to match like NCCL on gloo: every message carries one tag, so the two sides' posts
# pair up strictly in the order each side makes them (NCCL ignores tags altogether).
ORDERED_MATCHING_ENV = "PDSERVE_KV_ORDERED_MATCHING"


def ordered_matching() -> bool:
    """Whether gloo channels drop their tags (NCCL channels never have any)."""
    return os.environ.get(ORDERED_MATCHING_ENV, "") not in ("", "0")


# NCCL's group timeout is what its watchdog enforces on every operation, the header receive that
# waits for new work included; deadlines are enforced here instead (by polling, then aborting the
# group), so the watchdog must never fire first.
_NCCL_GROUP_TIMEOUT = datetime.timedelta(days=7)
_CUDA_POLL_S = 0.0002
_LATE_SLACK_S = 0.05  # a wait that ended this close to its deadline timed out


def _nccl_raises_instead_of_killing() -> None:
    """A failed NCCL operation must abort its communicator and raise, not end the process: the
    default async error handling tears the process down. Read by each NCCL group when built."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # CleanUpOnly
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "0")


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where one decode rank accepts channels (its TCPStore); the control plane carries it."""

    host: str
    port: int
    receiver_is_rank0: bool = True  # the decode side takes rank 0 of every pair's group


class _PairGroup(Protocol):
    """The calls a channel makes on its 2-rank group (a gloo or NCCL backend object)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int, /) -> dist.Work: ...

    def abort(self) -> None: ...


def _pair_group(backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL) -> _PairGroup:
    # torch's stub declares send/recv on ProcessGroup only; ProcessGroupGloo and ProcessGroupNCCL
    # are Backend subclasses at runtime and have both.
    return backend  # type: ignore[return-value]


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


class Channel:
    """One 2-rank process group. `isend`/`irecv` post; `wait` bounds every completion by a deadline.

    Thread-safe for posting from one thread while others wait: the backends lock per connection.
    """

    def __init__(
        self, pair_key: str, epoch: int, store: dist.Store, rank: int, device: torch.device
    ) -> None:
        self.pair_key = pair_key
        self.epoch = epoch
        self.rank = rank
        self.peer_rank = 1 - rank
        self.device = device
        self._store = dist.PrefixStore(f"{pair_key}/{epoch}", store)
        self._group: _PairGroup | None = None
        self._connected = threading.Event()
        self._connect_error: BaseException | None = None
        self._closed = threading.Event()
        self._group_lock = threading.Lock()  # close() and a finishing connect() hand the group over
        self.broken = False
        self.ordered = device.type == "cuda" or ordered_matching()
        self._broken_callbacks: list[Callable[[KVTransferError], None]] = []
        self.sends = SendStream(self)  # the prefill side's stream (a dialed channel)
        self.receives = RecvStream(self)  # the decode side's stream (a hosted channel)

    def __repr__(self) -> str:
        return f"Channel({self.pair_key}#{self.epoch}, rank {self.rank})"

    def connect(self, deadline: float) -> None:
        """Build the group; blocks until the peer joins or the deadline passes. A group that
        comes up after close() is aborted at once (close could not reach it)."""
        try:
            group = self._make_group(_timedelta(_remaining(deadline)))
            self._warm_up(group, deadline)
        except BaseException as exc:  # the constructor raises several types on a missing peer
            self._connect_error = exc
            self.broken = True
        else:
            with self._group_lock:
                closed = self._closed.is_set()
                if not closed:
                    self._group = group
            if closed:
                _abort(group)
        finally:
            self._connected.set()
        if self._connect_error is not None:
            raise KVTransferTimeout(
                f"{self}: the peer did not join before the deadline ({self._connect_error})"
            ) from self._connect_error

    def connect_in_background(self, deadline: float, raw_store: dist.Store) -> None:
        """Connect once the dialer announces itself. Group construction is serialized within a
        process, so starting it before the peer comes would block every other new channel here
        (a dead prefill rank would stall them all until its deadline)."""

        def run() -> None:
            dialing_key = f"{self.pair_key}/dialing/{self.epoch}"
            # check() is brief; a blocking store.wait would hold the store's lock for everyone.
            while not raw_store.check([dialing_key]):
                if self._closed.is_set():
                    return  # close() ended the wait: no thread outlives its host
                if _remaining(deadline) <= 0:
                    self._connect_error = TimeoutError("the prefill side never dialed")
                    self.broken = True
                    self._connected.set()
                    return
                time.sleep(_DIAL_POLL_S)
            try:
                self.connect(deadline)
            except KVTransferError:
                pass  # recorded in _connect_error; wait_connected reports it

        threading.Thread(target=run, name=f"connect-{self.pair_key}", daemon=True).start()

    @property
    def ready(self) -> bool:
        """Connected, and not broken: receives posted now are matched at once."""
        return self._connected.is_set() and self._connect_error is None and not self.broken

    def wait_connected(self, deadline: float) -> None:
        if not self._connected.wait(max(_remaining(deadline), 0.0)):
            raise KVTransferTimeout(f"{self}: the peer did not join before the deadline")
        if self._connect_error is not None:
            raise KVTransferTimeout(f"{self}: connecting failed ({self._connect_error})")

    def _make_group(self, timeout: datetime.timedelta) -> _PairGroup:
        if self.device.type == "cuda":
            _nccl_raises_instead_of_killing()
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _NCCL_GROUP_TIMEOUT
            return _pair_group(dist.ProcessGroupNCCL(self._store, self.rank, 2, options))
        # gloo: the timeout bounds the rendezvous; every wait passes its own.
        return _pair_group(dist.ProcessGroupGloo(self._store, self.rank, 2, timeout))

    def _warm_up(self, group: _PairGroup, deadline: float) -> None:
        """One message from rank 0 to rank 1 on the connecting thread: NCCL builds its
        communicator lazily in a pair's first operation, which must not be a transfer's (it would
        block whichever thread posts it, the decode loop's included)."""
        probe = torch.ones(1, device=self.device)
        if self.rank == 0:
            work = group.send([probe], 1, 0)
        else:
            work = group.recv([probe], 0, 0)
        self._wait_work(work, deadline)
        if probe.item() != 1:
            raise RuntimeError(f"the warm-up message arrived as {probe.item()}")

    def _wait_work(self, work: dist.Work, deadline: float) -> None:
        if self.device.type != "cuda":
            work.wait(_timedelta(_remaining(deadline)))
            return
        # NCCL: poll, so a late peer ends in our timeout, not in a watchdog abort of the process.
        while not work.is_completed():
            if _remaining(deadline) <= 0:
                raise TimeoutError("the operation did not complete before the deadline")
            time.sleep(_CUDA_POLL_S)
        work.wait()  # raises the communicator's error, if it had one

    def _live_group(self) -> _PairGroup:
        if self.broken or self._group is None:
            raise KVTransferError(f"{self} is broken or not connected")
        return self._group

    def isend(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self._live_group().send([tensor], self.peer_rank, 0 if self.ordered else tag)

    def irecv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self._live_group().recv([tensor], self.peer_rank, 0 if self.ordered else tag)

    def wait(self, work: dist.Work, deadline: float, what: str) -> None:
        """Wait for one posted op; any failure breaks the channel and raises a KVTransferError."""
        try:
            if _remaining(deadline) <= 0:
                raise TimeoutError("the deadline passed before the wait")
            self._wait_work(work, deadline)
        except Exception as exc:
            self.mark_broken()
            # Our own clock says whether the deadline passed; backends word it differently.
            late = _remaining(deadline) <= _LATE_SLACK_S
            kind = KVTransferTimeout if late else KVTransferError
            raise kind(f"{self}: {what} failed: {str(exc).splitlines()[0][:300]}") from exc

    def on_broken(self, callback: Callable[[KVTransferError], None]) -> None:
        """Call `callback` once when this channel breaks (at once if it has)."""
        self._broken_callbacks.append(callback)

    def mark_broken(self) -> None:
        if not self.broken:
            self.broken = True
            self.close()
        callbacks, self._broken_callbacks = self._broken_callbacks, []
        for callback in callbacks:
            callback(KVTransferError(f"{self} broke"))

    def close(self) -> None:
        """Drop the group: the connection closes, so nothing more lands in a posted receive (its
        wait still runs to its own deadline). A connect still waiting for the peer to dial ends
        too, and so do the waits on it (a thread left polling the store when the process exits
        aborts the interpreter's teardown)."""
        with self._group_lock:
            self._closed.set()
            group, self._group = self._group, None
        if not self._connected.is_set():
            self._connect_error = self._connect_error or RuntimeError("the channel was closed")
            self.broken = True
            self._connected.set()
        if group is not None:
            _abort(group)


def _abort(group: _PairGroup) -> None:
    try:
        group.abort()
    except Exception:  # noqa: S110 - best effort: the peer may be gone already
        pass


class ChannelHost:
    """A decode rank's side: hosts the rendezvous store and the channels prefill ranks dial."""

    def __init__(self, device: torch.device | str = "cpu", host: str = "127.0.0.1") -> None:
        self.device = torch.device(device)
        # port 0: the OS picks a free port; the endpoint tells prefill ranks which one.
        self._store = create_store(host, 0, None, True, _STORE_OP_TIMEOUT_S, wait_for_workers=False)
        self.endpoint = ChannelEndpoint(host, self._store.port)
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def accept(self, pair_key: str, transfer_key: str, deadline: float) -> Channel:
        """The channel one transfer will use; (re)connects it in the background if needed."""
        with self._lock:
            channel = self._channels.get(pair_key)
            if channel is not None and self._store.check([f"{pair_key}/broken/{channel.epoch}"]):
                channel.mark_broken()  # the prefill side saw this epoch fail
            if channel is None or channel.broken:
                epoch = channel.epoch + 1 if channel is not None else 1
                rank = 0 if self.endpoint.receiver_is_rank0 else 1
                channel = Channel(pair_key, epoch, self._store, rank, self.device)
                self._channels[pair_key] = channel
                channel.connect_in_background(deadline, self._store)
            self._store.set(f"{pair_key}/t/{transfer_key}", str(channel.epoch))
            return channel

    def forget_transfer(self, pair_key: str, transfer_key: str) -> None:
        self._store.delete_key(f"{pair_key}/t/{transfer_key}")

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class ChannelDialer:
    """A prefill rank's side: joins decode ranks' channels on demand, one per pair."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}
        # Keyed by endpoint too: a restarted decode rank has a new store (new port) whose epochs
        # start again at 1, so its channels must not be confused with the old ones.
        self._channels: dict[tuple[str, int, str], Channel] = {}
        self._lock = threading.Lock()

    def dial(
        self, endpoint: ChannelEndpoint, pair_key: str, transfer_key: str, deadline: float
    ) -> Channel:
        """The channel for this transfer, connected; waits for the decode side to accept it."""
        store = self._store_for(endpoint, deadline)
        key = f"{pair_key}/t/{transfer_key}"
        channel_key = (endpoint.host, endpoint.port, pair_key)
        try:
            # The decode side publishes the key before its ticket leaves it and deletes it when the
            # receive ends: a missing key means nobody waits for this transfer any more (aborted
            # or expired). Waiting for it instead would hold this decode instance's dial lock, and
            # stall every other send to it, until the deadline.
            store.set_timeout(_timedelta(min(_remaining(deadline), _STORE_OP_TIMEOUT_S)))
            if not store.check([key]):
                raise KVTransferError(
                    f"decode side of {pair_key} no longer expects transfer {transfer_key}"
                )
            epoch = int(store.get(key))
        except KVTransferError:
            raise
        except Exception as exc:
            with self._lock:  # the decode side may be gone: reconnect the store next time
                self._stores.pop((endpoint.host, endpoint.port), None)
            raise KVTransferTimeout(
                f"decode side of {pair_key} did not accept transfer {transfer_key} in time: {exc}"
            ) from exc
        with self._lock:
            channel = self._channels.get(channel_key)
            reuse = channel is not None and channel.epoch == epoch and not channel.broken
        if reuse:
            # Another send may have made this channel a moment ago and still be connecting it:
            # hand it out only once it is connected (or report why it is not).
            assert channel is not None
            channel.wait_connected(deadline)
            return channel
        with self._lock:
            channel = self._channels.get(channel_key)
            if channel is not None and channel.epoch == epoch and not channel.broken:
                # made by a concurrent dial between the two locked sections
                channel.wait_connected(deadline)
                return channel
            if channel is not None and channel.epoch >= epoch:
                self._report_broken(store, channel)
                raise KVTransferError(
                    f"{channel} broke and the decode side has not rebuilt it yet; retry"
                )
            if channel is not None:
                channel.close()
            rank = 1 if endpoint.receiver_is_rank0 else 0
            channel = Channel(pair_key, epoch, store, rank, self.device)
            self._channels[channel_key] = channel
        if store.add(f"{pair_key}/dialing/{epoch}", 1) > 1:
            # An earlier incarnation of this prefill rank (a restarted process with the same
            # instance id) joined this epoch; its rendezvous keys are stale. Fail fast; the
            # decode side rebuilds on its next accept.
            channel.mark_broken()
            self._report_broken(store, channel)
            raise KVTransferError(f"{channel} was joined by an earlier process; retry")
        channel.connect(deadline)
        return channel

    def report_broken(self, endpoint: ChannelEndpoint, channel: Channel) -> None:
        """Tell the decode side that this epoch failed here, so it rebuilds on its next accept."""
        store = self._stores.get((endpoint.host, endpoint.port))
        if store is not None:
            self._report_broken(store, channel)

    @staticmethod
    def _report_broken(store: dist.Store, channel: Channel) -> None:
        try:
            store.set(f"{channel.pair_key}/broken/{channel.epoch}", "1")
        except Exception:  # noqa: S110 - the decode side may be dead; nothing to tell then
            pass

    def _store_for(self, endpoint: ChannelEndpoint, deadline: float) -> dist.TCPStore:
        address = (endpoint.host, endpoint.port)
        with self._lock:
            store = self._stores.get(address)
        if store is None:
            try:
                store = dist.TCPStore(
                    endpoint.host,
                    endpoint.port,
                    None,
                    False,
                    timeout=_timedelta(min(_remaining(deadline), _STORE_OP_TIMEOUT_S)),
                )
            except Exception as exc:
                raise KVTransferTimeout(f"cannot reach decode endpoint {address}: {exc}") from exc
            with self._lock:
                store = self._stores.setdefault(address, store)
        return store

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stores.clear()
