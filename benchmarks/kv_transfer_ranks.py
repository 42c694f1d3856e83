"""The rank processes of benchmarks/kv_transfer_speed.py: each owns KV caches, a channel host (decode)
or dialer (prefill), the rank data paths and the raw baseline's buffers, and runs commands the
benchmark's parent process sends it. Every rank is its own spawned process (gloo on CPU)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec, local_kv_heads
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.messages import KVTicket
from kv_transfer.rank_receiver import KVRankReceiver
from kv_transfer.rank_sender import KVRankSender
from kv_transfer.rendezvous import ChannelDialer, ChannelHost


class BenchWorker:
    """Parent-side handle of one rank process."""

    def __init__(self, role: str, spec: tuple[Any, ...], cpus: list[int] | None = None) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.commands, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_worker_main,
            args=(role, spec, self.commands, self.replies, cpus),
            daemon=True,
        )
        self.process.start()

    def post(self, command: RankCommand) -> None:
        self.commands.put(command)

    def reply(self, timeout: float = 120.0) -> Any:
        kind, value = self.replies.get(timeout=timeout)
        if kind == "error":
            raise RuntimeError(value)
        return value

    def call(self, command: RankCommand) -> Any:
        self.post(command)
        return self.reply()

    def stop(self) -> None:
        self.post(Exit())
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_bench_workers(
    num_prefill: int, num_decode: int, spec: tuple[Any, ...]
) -> tuple[list[BenchWorker], list[BenchWorker], dict[str, list[int]]]:
    """The rank processes; with two or more cores, prefill ranks pinned to the first half and
    decode ranks to the second, so the two sides of a comparison never share a core."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    pins = {"prefill": cores[:half], "decode": cores[half:]} if half else {}
    prefill = [BenchWorker("prefill", spec, pins.get("prefill")) for _ in range(num_prefill)]
    decode = [BenchWorker("decode", spec, pins.get("decode")) for _ in range(num_decode)]
    for worker in prefill + decode:
        worker.reply()  # ready
    return prefill, decode, pins


class _RankState:
    """One rank process: caches per (tp_size, rank) layout, its channels, the raw baseline."""

    def __init__(self, role: str, spec: tuple[Any, ...]) -> None:
        """spec: (num_layers, num_blocks, block_size, num_kv_heads, head_dim[, kv_cache_dtype])."""
        self.role = role
        shape = spec[:5]
        self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = shape
        self.kv_dtype = spec[5] if len(spec) > 5 else "auto"
        self.caches: dict[tuple[int, int], KVCache] = {}
        self.host = ChannelHost() if role == "decode" else None
        self.dialer = ChannelDialer()
        self.pending: Any = None
        self.ranks: dict[tuple[str, int, int], Any] = {}
        self.raw_buffers: dict[str, torch.Tensor] = {}

    def cache(self, tp_size: int, rank: int) -> KVCache:
        key = (tp_size, rank)
        if key not in self.caches:
            num_local = len(local_kv_heads(self.num_kv_heads, tp_size, rank))
            spec = KVCacheSpec(
                self.num_layers,
                self.num_blocks,
                self.block_size,
                num_local,
                self.head_dim,
                torch.float32,
                self.kv_dtype,
            )
            self.caches[key] = KVCache(spec)
            data = self.caches[key].data
            data.normal_() if data.is_floating_point() else data.random_(0, 256)
        return self.caches[key]

    def endpoint(self) -> ChannelEndpoint:
        assert self.host is not None
        return self.host.endpoint

    def recv(self, ticket: KVTicket, rank: int) -> None:
        assert self.host is not None
        cache = self.cache(ticket.decode_tp_size, rank)
        key = ("recv", ticket.decode_tp_size, rank)
        if key not in self.ranks:  # one per rank, as a worker keeps it (its staging pool too)
            self.ranks[key] = KVRankReceiver(
                cache, self.host, rank, self.num_kv_heads, export_now=True
            )
        self.pending = self.ranks[key].receive(ticket)

    def wait_recv(self) -> float:
        """When the data landed (CLOCK_MONOTONIC is one clock for every process on a machine)."""
        self.pending.wait(120.0)
        return self.pending.finished_at

    def send(self, ticket: KVTicket, rank: int, block_ids: list[int]) -> float:
        cache = self.cache(ticket.prefill_tp_size, rank)
        start = time.monotonic()
        key = ("send", ticket.prefill_tp_size, rank)
        if key not in self.ranks:
            self.ranks[key] = KVRankSender(cache, self.dialer, rank, self.num_kv_heads)
        handle = self.ranks[key].start(ticket, block_ids)
        if ticket.layerwise:
            for layer in range(self.num_layers):
                handle.send_layer(layer)
        handle.finish(first_token_id=0)
        handle.wait(120.0)
        return start

    def raw_recv(self, num_bytes: int, pair_keys: tuple[str, ...] = ("raw",)) -> None:
        """Receive `num_bytes` on each channel of `pair_keys` (one contiguous tensor each)."""
        assert self.host is not None
        deadline = time.monotonic() + 60.0
        # Reused buffers, as the KV lands in a cache that is already paged in: fresh ones
        # would charge the baseline for first-touch page faults the KV path never pays.
        waits = []
        for pair_key in pair_keys:
            channel = self.host.accept(pair_key, "raw", deadline)
            waits.append(_RawWait(channel, self._raw_buffer(pair_key, num_bytes), deadline))
        self.pending = _AllWaits(waits)

    def _raw_buffer(self, key: str, num_bytes: int) -> torch.Tensor:
        buffer = self.raw_buffers.get(key)
        if buffer is None or buffer.numel() != num_bytes // 4:
            buffer = self.raw_buffers[key] = torch.ones(num_bytes // 4)
        return buffer

    def raw_send(
        self,
        endpoints: list[ChannelEndpoint],
        num_bytes: int,
        pair_keys: tuple[str, ...] = ("raw",),
    ) -> float:
        """Send `num_bytes` as one contiguous tensor on each (endpoint, pair key) at once."""
        buffers = [self._raw_buffer(k, num_bytes) for k in pair_keys]
        start = time.monotonic()
        deadline = time.monotonic() + 60.0
        channels = [
            self.dialer.dial(endpoint, pair_key, "raw", deadline)
            for endpoint, pair_key in zip(endpoints, pair_keys, strict=True)
        ]
        works = [c.isend(b, 1) for c, b in zip(channels, buffers, strict=True)]
        for channel, work in zip(channels, works, strict=True):
            channel.wait(work, deadline, "raw send")
        return start


class _RawWait:
    """The raw baseline's receive, timed like a RecvHandle: a thread waits and stamps the end.
    Posted at once when the channel is up (the first time only after the sender has dialed,
    since connecting needs both sides)."""

    def __init__(self, channel: Any, buffer: torch.Tensor, deadline: float) -> None:
        self.channel, self.buffer, self.deadline = channel, buffer, deadline
        self.finished_at: float | None = None
        self.work = channel.irecv(buffer, 1) if channel._connected.is_set() else None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.work is None:
            self.channel.wait_connected(self.deadline)
            self.work = self.channel.irecv(self.buffer, 1)
        self.channel.wait(self.work, self.deadline, "raw receive")
        self.finished_at = time.monotonic()

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)


class _AllWaits:
    """Several raw receives on one rank: landed when the last one has."""

    def __init__(self, waits: list[_RawWait]) -> None:
        self.waits = waits
        self.finished_at: float | None = None

    def wait(self, timeout: float) -> None:
        for wait in self.waits:
            wait.wait(timeout)
        ends = [w.finished_at for w in self.waits]
        self.finished_at = None if None in ends else max(ends)  # type: ignore[type-var]


def _worker_main(
    role: str, spec: tuple[Any, ...], commands: Any, replies: Any, cpus: list[int] | None
) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    state = _RankState(role, spec)
    replies.put(("ok", "ready"))
    while True:
        command = commands.get()
        if isinstance(command, Exit):
            return
        try:
            replies.put(("ok", command.run(state)))
        except Exception as exc:  # report, keep serving: the parent decides
            replies.put(("error", repr(exc)))


# The commands a rank process runs: typed, each calls the _RankState method it names.
class RankCommand:
    def run(self, state: _RankState) -> Any:
        raise NotImplementedError


class Exit(RankCommand):
    """Leave the command loop (the process ends)."""


class Endpoint(RankCommand):
    def run(self, state: _RankState) -> ChannelEndpoint:
        return state.endpoint()


@dataclass(frozen=True)
class Recv(RankCommand):
    ticket: KVTicket
    rank: int

    def run(self, state: _RankState) -> None:
        state.recv(self.ticket, self.rank)


class WaitRecv(RankCommand):
    def run(self, state: _RankState) -> float:
        return state.wait_recv()


@dataclass(frozen=True)
class Send(RankCommand):
    ticket: KVTicket
    rank: int
    block_ids: list[int]

    def run(self, state: _RankState) -> float:
        return state.send(self.ticket, self.rank, self.block_ids)


@dataclass(frozen=True)
class RawRecv(RankCommand):
    num_bytes: int
    pair_keys: tuple[str, ...] = ("raw",)

    def run(self, state: _RankState) -> None:
        state.raw_recv(self.num_bytes, self.pair_keys)


@dataclass(frozen=True)
class RawSend(RankCommand):
    endpoints: list[ChannelEndpoint]
    num_bytes: int
    pair_keys: tuple[str, ...] = ("raw",)

    def run(self, state: _RankState) -> float:
        return state.raw_send(self.endpoints, self.num_bytes, self.pair_keys)
