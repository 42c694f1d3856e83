"""Rendezvous of the pair channels: decode ranks host them, prefill ranks dial them.

Every decode rank hosts one TCPStore (its `ChannelEndpoint`, carried in tickets);
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
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from engine.net import create_store
from kv_transfer.channel import (
    STORE_OP_TIMEOUT_S,
    Channel,
    ChannelEndpoint,
    as_timedelta,
    remaining_s,
)
from kv_transfer.errors import KVTransferError, KVTransferTimeout
from kv_transfer.same_node import NODE_ID, visible_gpus

_MISSING = "\x00missing"  # never an epoch


class ChannelHost:
    """A decode rank's side: hosts the rendezvous store and the channels prefill ranks dial."""

    def __init__(self, device: torch.device | str = "cpu", host: str = "127.0.0.1") -> None:
        self.device = torch.device(device)
        # port 0: the OS picks a free port; the endpoint tells prefill ranks which one.
        self._store = create_store(host, 0, None, True, STORE_OP_TIMEOUT_S, wait_for_workers=False)
        self.endpoint = ChannelEndpoint(
            host, self._store.port, node_id=NODE_ID, gpus=visible_gpus(self.device)
        )
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def accept(
        self, pair_key: str, transfer_key: str, deadline: float, dest: bytes | None = None
    ) -> Channel:
        """The channel one transfer will use; (re)connects it in the background if needed.
        `dest`: the receiving rank's exported cache (CPU), published with each new channel
        before the transfer's key: a same-node dialer may then write part of the KV itself."""
        with self._lock:
            channel = self._channels.get(pair_key)
            if channel is not None and self._store.check([f"{pair_key}/broken/{channel.epoch}"]):
                channel.mark_broken()  # the prefill side saw this epoch fail
            if channel is None or channel.broken:
                epoch = channel.epoch + 1 if channel is not None else 1
                rank = 0 if self.endpoint.receiver_is_rank0 else 1
                channel = Channel(pair_key, epoch, self._store, rank, self.device)
                self._channels[pair_key] = channel
                if dest is not None:
                    channel.dest = dest  # which cache the dialer may write into (rank_receiver)
                    self._store.set(f"{pair_key}/same_node_dest/{epoch}", dest)  # type: ignore[arg-type]
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
        self,
        endpoint: ChannelEndpoint,
        pair_key: str,
        transfer_key: str,
        deadline: float,
        source: bytes | None = None,
    ) -> Channel:
        """The channel for this transfer, connected; waits for the decode side to accept it.
        `source`: this rank's exported cache, for the same-node transport (same_node.py); a
        pair always dials the same way, so its channels keep one transport."""
        store = self._store_for(endpoint, deadline)
        key = f"{pair_key}/t/{transfer_key}"
        channel_key = (endpoint.host, endpoint.port, pair_key)
        try:
            # The decode side publishes the key before its ticket leaves it and deletes it when the
            # receive ends: a missing key means nobody waits for this transfer any more (aborted
            # or expired). Waiting for it instead would hold this decode instance's dial lock, and
            # stall every other send to it, until the deadline.
            store.set_timeout(as_timedelta(min(remaining_s(deadline), STORE_OP_TIMEOUT_S)))
            # One round trip: compare_set leaves a missing key missing and returns `expected`,
            # and returns an existing key's value unchanged (a check and a get cost two).
            value = store.compare_set(key, _MISSING, _MISSING)
            if value in (_MISSING.encode(), b""):  # b"": should a later torch answer a miss so
                raise KVTransferError(
                    f"decode side of {pair_key} no longer expects transfer {transfer_key}"
                )
            epoch = int(value)
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
        dest = None
        if source is not None:
            dest_key = f"{pair_key}/same_node_dest/{epoch}"
            try:  # published before the transfer's key, when the decode rank exported its cache
                dest = store.get(dest_key) if store.check([dest_key]) else None
            except Exception:  # noqa: S110 - the decode side may be gone: connecting says so
                pass
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
            if source is not None:
                channel.use_same_node(source, dest)
            self._channels[channel_key] = channel
        if source is not None:  # told before the dial, which the decode side waits for
            store.set(f"{pair_key}/same_node/{epoch}", source)  # type: ignore[arg-type]
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
                    timeout=as_timedelta(min(remaining_s(deadline), STORE_OP_TIMEOUT_S)),
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
