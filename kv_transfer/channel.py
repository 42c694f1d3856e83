"""Point-to-point channels: one 2-rank process group per (prefill rank, decode rank) pair.

Each channel is its own process group built from its own store, never the default group, so a
worker's TP group and its channels coexist and one dead peer breaks one channel, not the cluster.
Gloo on CPU tensors, NCCL on CUDA tensors; the rest of kv_transfer does not know which.

After any failed or timed-out wait the group's state is undefined (gloo closes the connection on a
timeout), so the channel is marked broken and rebuilt on next use; the dialer also records the
broken epoch in the store so that the host rebuilds even if its side never saw the failure.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from engine.rank_device import device_thread
from kv_transfer.errors import KVTransferError, KVTransferTimeout
from kv_transfer.same_node import map_cache
from kv_transfer.streams import RecvStream, SendStream

logger = logging.getLogger(__name__)
STORE_OP_TIMEOUT_S = 30.0
_DIAL_POLL_S = 0.002
# Tests set it to match like NCCL on gloo: every message carries one tag, so the two sides' posts
# pair up strictly in the order each side makes them (NCCL ignores tags altogether).
ORDERED_MATCHING_ENV = "PDSERVE_KV_ORDERED_MATCHING"


# Tests set it to split a CPU channel as a CUDA one is split (control on one gloo group, the KV on
# a second one standing in for NCCL), so the two streams' ordering runs on CPU.
SPLIT_GROUPS_ENV = "PDSERVE_KV_SPLIT_GROUPS"


def ordered_matching() -> bool:
    """Whether gloo channels drop their tags (NCCL channels never have any)."""
    return os.environ.get(ORDERED_MATCHING_ENV, "") not in ("", "0")


# NCCL's group timeout is what its watchdog enforces on every operation. NCCL carries only KV,
# posted once a transfer is known to be next, but a transfer's deadline can still be long: the
# deadlines are enforced here (by polling, then aborting the group), and the watchdog must never
# fire first.
_NCCL_GROUP_TIMEOUT = datetime.timedelta(days=7)
_CUDA_POLL_S = 0.00005
_CUDA_POLL_MAX_S = 0.001
_LATE_SLACK_S = 0.05  # a wait that ended this close to its deadline timed out


def _nccl_raises_instead_of_killing() -> None:
    """A failed NCCL operation must abort its communicator and raise, not end the process: the
    default async error handling tears the process down. Read by each NCCL group when built."""
    for name, value in (
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
        ("TORCH_NCCL_BLOCKING_WAIT", "0"),
    ):
        if os.environ.get(name, value) != value:  # 1 and 3 tear the process down on an error
            logger.warning(
                "%s=%s would end this process on a KV channel error; using %s",
                name,
                os.environ[name],
                value,
            )
        os.environ[name] = value  # 2: CleanUpOnly


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where one decode rank accepts channels (its TCPStore); the control plane carries it."""

    host: str
    port: int
    receiver_is_rank0: bool = True  # the decode side takes rank 0 of every pair's group
    node_id: str = ""  # the decode rank's machine (same_node.NODE_ID); "" when unknown
    # The UUIDs of the GPUs the decode rank sees, whose memory it can map (same_node.pair_transport)
    gpus: tuple[str, ...] = ()


class _PairGroup(Protocol):
    """The calls a channel makes on its 2-rank group (a gloo or NCCL backend object)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int, /) -> dist.Work: ...

    def abort(self) -> None: ...


def _pair_group(backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL) -> _PairGroup:
    # torch's stub declares send/recv on ProcessGroup only; ProcessGroupGloo and ProcessGroupNCCL
    # are Backend subclasses at runtime and have both.
    return backend  # type: ignore[return-value]


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def remaining_s(deadline: float) -> float:
    return deadline - time.monotonic()


@dataclass(frozen=True)
class Posted:
    """A posted send or receive, and whether its wait polls (NCCL) or blocks (gloo)."""

    work: dist.Work
    polled: bool


class Channel:
    """One rank pair. `isend`/`irecv` post; `wait` bounds every completion by a deadline.

    On CPU one gloo group carries everything. On CUDA two groups share the pair's store prefix:
    control messages (CPU tensors: headers, trailers) go over gloo and the KV (CUDA tensors) over
    NCCL. A header receive waits for new work on a socket, never as an NCCL kernel kept running on
    the GPU, and a transfer's NCCL receives are posted only once its header named it: each group
    is its own stream in post order, and both sides post to each in the same order.

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
        self._group: _PairGroup | None = None  # control (and, on CPU, the KV too): gloo
        self._data: _PairGroup | None = None  # the KV's group: NCCL on CUDA, else `_group`
        self._connected = threading.Event()
        self._connect_error: BaseException | None = None
        self._closed = threading.Event()
        self._group_lock = threading.Lock()  # close() and a finishing connect() hand the group over
        self.broken = False
        self.ordered = ordered_matching()  # gloo only: NCCL ignores tags whatever they are
        # Control and KV on two groups (the class docstring): always on CUDA; on CPU for tests.
        self.split = device.type == "cuda" or os.environ.get(SPLIT_GROUPS_ENV, "") not in ("", "0")
        # The same-node transport: control messages only (gloo, CPU), the KV through `source`,
        # the prefill rank's exported cache (same_node.py). Set before connecting.
        self.same_node = False
        self.source: bytes | None = None
        self._mapped: torch.Tensor | None = None  # `source` mapped here, for the channel's life
        # The decode rank's exported cache (CPU): on the prefill side, it then writes part of a
        # large transfer itself (same_node.py's split); on the decode side, the one published
        # with this channel. None: the decode side copies it all.
        self.dest: bytes | None = None
        self._mapped_dest: torch.Tensor | None = None
        self._broken_callbacks: list[Callable[[KVTransferError], None]] = []
        self.sends = SendStream(self)  # the prefill side's stream (a dialed channel)
        self.receives = RecvStream(self)  # the decode side's stream (a hosted channel)

    def __repr__(self) -> str:
        return f"Channel({self.pair_key}#{self.epoch}, rank {self.rank})"

    def connect(self, deadline: float) -> None:
        """Build the group; blocks until the peer joins or the deadline passes. A group that
        comes up after close() is aborted at once (close could not reach it)."""
        groups: list[_PairGroup] = []
        try:
            timeout = as_timedelta(remaining_s(deadline))
            # gloo: the timeout bounds the rendezvous; every wait passes its own.
            groups.append(_pair_group(dist.ProcessGroupGloo(self._store, self.rank, 2, timeout)))
            self._warm_up(groups[0], torch.device("cpu"), deadline)
            if self.device.type == "cuda":
                groups.append(self._nccl_group())
            elif self.split:
                store = dist.PrefixStore("data", self._store)
                groups.append(_pair_group(dist.ProcessGroupGloo(store, self.rank, 2, timeout)))
            if len(groups) > 1:
                self._warm_up(groups[1], self.device, deadline)
        except BaseException as exc:  # the constructor raises several types on a missing peer
            self._connect_error = exc
            self.broken = True
            for group in groups:
                _abort(group)
        else:
            with self._group_lock:
                closed = self._closed.is_set()
                if not closed:
                    self._group, self._data = groups[0], groups[-1]
            if closed:
                for group in groups:
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
            source_key = f"{self.pair_key}/same_node/{self.epoch}"
            # check() is brief; a blocking store.wait would hold the store's lock for everyone.
            while not raw_store.check([dialing_key]):
                if self._closed.is_set():
                    return  # close() ended the wait: no thread outlives its host
                if remaining_s(deadline) <= 0:
                    self._connect_error = TimeoutError("the prefill side never dialed")
                    self.broken = True
                    self._connected.set()
                    return
                time.sleep(_DIAL_POLL_S)
            if raw_store.check([source_key]):  # the dialer chose the same-node transport
                self.use_same_node(raw_store.get(source_key))
            try:
                self.connect(deadline)
            except KVTransferError:
                pass  # recorded in _connect_error; wait_connected reports it

        # NCCL binds the pair's communicator to the current device of the thread that builds it.
        device_thread(self.device, run, f"connect-{self.pair_key}").start()

    def use_same_node(self, source: bytes, dest: bytes | None = None) -> None:
        """Carry control messages only, on gloo; the KV comes from `source` (before connect),
        and the prefill side may write part of it into `dest`, the decode rank's cache."""
        self.same_node, self.source = True, source
        self.dest = dest or self.dest  # the decode side set its own when it made the channel
        self.device = torch.device("cpu")
        self.split = False  # no KV on the wire
        self.ordered = ordered_matching()

    def mapped_source(self) -> torch.Tensor:
        """The prefill rank's cache, mapped on first use (only the channel's reader calls this).
        The mapping lives as long as the channel: a rebuilt channel maps the handle it is given,
        so a restarted exporter is never read through an old mapping."""
        if self._mapped is None:
            if self.source is None:
                raise KVTransferError(f"{self} carries no same-node source")
            self._mapped = map_cache(self.source)
        return self._mapped

    def mapped_dest(self) -> torch.Tensor | None:
        """The decode rank's cache, mapped on first use by the prefill side (its send thread);
        None when it was not exported or cannot be mapped (then the decode side copies all)."""
        if self._mapped_dest is None and self.dest is not None:
            try:
                self._mapped_dest = map_cache(self.dest)
            except KVTransferError as exc:
                logger.warning("%s: the decode rank's cache cannot be mapped: %s", self, exc)
                self.dest = None
        return self._mapped_dest

    @property
    def ready(self) -> bool:
        """Connected, and not broken: receives posted now are matched at once."""
        return self._connected.is_set() and self._connect_error is None and not self.broken

    def wait_connected(self, deadline: float) -> None:
        if not self._connected.wait(max(remaining_s(deadline), 0.0)):
            raise KVTransferTimeout(f"{self}: the peer did not join before the deadline")
        if self._connect_error is not None:
            raise KVTransferTimeout(f"{self}: connecting failed ({self._connect_error})")

    def _nccl_group(self) -> _PairGroup:
        _nccl_raises_instead_of_killing()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _NCCL_GROUP_TIMEOUT
        store = dist.PrefixStore("nccl", self._store)  # beside the gloo group's keys
        return _pair_group(dist.ProcessGroupNCCL(store, self.rank, 2, options))

    def _warm_up(self, group: _PairGroup, device: torch.device, deadline: float) -> None:
        """One message from rank 0 to rank 1 on the connecting thread: NCCL builds its
        communicator lazily in a pair's first operation, which must not be a transfer's (it would
        block whichever thread posts it, the decode loop's included)."""
        probe = torch.ones(1, device=device)
        if self.rank == 0:
            work = group.send([probe], 1, 0)
        else:
            work = group.recv([probe], 0, 0)
        self._wait_work(Posted(work, device.type == "cuda"), deadline)
        if probe.item() != 1:
            raise RuntimeError(f"the warm-up message arrived as {probe.item()}")

    def _wait_work(self, posted: Posted, deadline: float) -> None:
        work = posted.work
        if not posted.polled:
            work.wait(as_timedelta(remaining_s(deadline)))
            return
        # NCCL: poll, so a late peer ends in our timeout, not in a watchdog abort of the process.
        # The pause grows to _CUDA_POLL_MAX_S, for a wait on a peer still sending its KV.
        pause = _CUDA_POLL_S
        while not work.is_completed():
            if remaining_s(deadline) <= 0:
                raise TimeoutError("the operation did not complete before the deadline")
            time.sleep(pause)
            pause = min(2 * pause, _CUDA_POLL_MAX_S)
        work.wait()  # raises the communicator's error, if it had one

    def _post(self, tensor: torch.Tensor, tag: int, send: bool, control: bool) -> Posted:
        """Post a control message (a CPU tensor) on the gloo group, the KV on the KV's group
        (NCCL on CUDA). Gloo messages are tagged unless matching in order; NCCL ignores tags."""
        group, data = self._group, self._data
        if self.broken or group is None or data is None:
            raise KVTransferError(f"{self} is broken or not connected")
        if not control:
            group = data
        polled = tensor.is_cuda
        tag = 0 if polled or self.ordered else tag
        post = group.send if send else group.recv
        return Posted(post([tensor], self.peer_rank, tag), polled)

    def isend(self, tensor: torch.Tensor, tag: int, control: bool = False) -> Posted:
        return self._post(tensor, tag, True, control)

    def irecv(self, tensor: torch.Tensor, tag: int, control: bool = False) -> Posted:
        return self._post(tensor, tag, False, control)

    def wait(self, work: Posted, deadline: float, what: str) -> None:
        """Wait for one posted op; any failure breaks the channel and raises a KVTransferError."""
        try:
            if remaining_s(deadline) <= 0:
                raise TimeoutError("the deadline passed before the wait")
            self._wait_work(work, deadline)
        except Exception as exc:
            self.mark_broken()
            # Our own clock says whether the deadline passed; backends word it differently.
            late = remaining_s(deadline) <= _LATE_SLACK_S
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
            group, data = self._group, self._data
            self._group = self._data = None
        self._mapped = self._mapped_dest = None  # unmapped once a copy using it is done
        if not self._connected.is_set():
            self._connect_error = self._connect_error or RuntimeError("the channel was closed")
            self.broken = True
            self._connected.set()
        for dropped in {id(g): g for g in (group, data) if g is not None}.values():
            _abort(dropped)


def _abort(group: _PairGroup) -> None:
    try:
        group.abort()
    except Exception:  # noqa: S110 - best effort: the peer may be gone already
        pass
