"""Worker processes for the multi-process kv_transfer tests: each plays one rank (or several),
driven by commands over a queue, so one set of processes serves many scenarios.

Source KV is a pure function of (seed, global head), so a decode rank can check every byte it
received without seeing the sender's cache.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.kv_cache import KVCache, KVCacheSpec, local_kv_heads
from kv_transfer import rank_receiver, send_handle
from kv_transfer.channel import Channel
from kv_transfer.rank_receiver import KVRankReceiver, RecvHandle
from kv_transfer.rank_sender import KVRankSender, SendHandle
from kv_transfer.rendezvous import ChannelDialer, ChannelHost

NUM_LAYERS = 2
NUM_BLOCKS = 16
BLOCK_SIZE = 4
HEAD_DIM = 8
COMMAND_TIMEOUT_S = 60.0


def full_kv(seed: int, num_kv_heads: int) -> torch.Tensor:
    """The whole model's KV for a seed: [L, 2, num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    return torch.randn(shape, generator=generator)


def rank_spec(num_kv_heads: int, tp_size: int, rank: int, head_dim: int = HEAD_DIM) -> KVCacheSpec:
    num_local = len(local_kv_heads(num_kv_heads, tp_size, rank))
    return KVCacheSpec(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, num_local, head_dim, torch.float32)


def source_cache(seed: int, num_kv_heads: int, tp_size: int, rank: int) -> KVCache:
    cache = KVCache(rank_spec(num_kv_heads, tp_size, rank))
    heads = local_kv_heads(num_kv_heads, tp_size, rank)
    cache.data.copy_(full_kv(seed, num_kv_heads)[:, :, heads.start : heads.stop])
    return cache


def check_received(
    cache: KVCache,
    seed: int,
    num_kv_heads: int,
    tp_size: int,
    rank: int,
    src_block_ids: list[int],
    dst_block_ids: list[int],
    only_dst: bool = False,
) -> str | None:
    """None if the destination blocks hold the source bytes exactly and all else is still zero
    (`only_dst`: the destination blocks alone, in a cache other transfers land in too)."""
    heads = local_kv_heads(num_kv_heads, tp_size, rank)
    expected = torch.zeros_like(cache.data)
    source = full_kv(seed, num_kv_heads)[:, :, heads.start : heads.stop]
    expected[:, :, :, dst_block_ids] = source[:, :, :, src_block_ids]
    data = cache.data
    if only_dst:
        data, expected = data[:, :, :, dst_block_ids], expected[:, :, :, dst_block_ids]
    if torch.equal(data.view(torch.int32), expected.view(torch.int32)):
        return None
    wrong = (data != expected).nonzero()[:5].tolist()
    return f"rank {rank}: {int((data != expected).sum())} wrong values, first at {wrong}"


@dataclass
class Worker:
    """Parent-side handle of one worker process."""

    process: Any
    commands: Any
    replies: Any

    def call(self, *command: Any, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        self.commands.put(command)
        return self.reply(timeout)

    def reply(self, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        kind, value = self.replies.get(timeout=timeout)
        if kind == "error":
            raise RuntimeError(f"worker {self.process.pid} failed:\n{value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("exit",))
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(num: int, group_port: int | None = None) -> list[Worker]:
    """`num` worker processes; with `group_port` they also form a default gloo group of `num`."""
    context = mp.get_context("spawn")
    workers = []
    for rank in range(num):
        commands, replies = context.Queue(), context.Queue()
        process = context.Process(
            target=_worker_main, args=(commands, replies, rank, num, group_port), daemon=True
        )
        process.start()
        workers.append(Worker(process, commands, replies))
    for worker in workers:
        worker.reply()  # "ready"
    return workers


class _WorkerState:
    def __init__(self) -> None:
        self.host: ChannelHost | None = None
        self.dialer = ChannelDialer()
        self.handles: dict[str, tuple[Any, ...]] = {}
        self.senders: dict[tuple[int, int, int], KVRankSender] = {}
        # Same-node split mode (split_mode): each decode rank shape keeps one exported cache and
        # receiver, as a serving decode rank has, so a same-node sender may write into it.
        self.split = False
        self.receivers: dict[tuple[int, int, int], KVRankReceiver] = {}
        self.ended: dict[str, float | None] = {}  # receives waited for: when each ended

    def split_mode(self, min_bytes: int, write_window_s: float) -> None:
        """Let same-node senders here write their share of transfers from `min_bytes` a lane
        (this suite's blocks are tiny); receivers here export, and give them `write_window_s`
        from their ack to start their copies."""
        send_handle._SPLIT_MIN_BYTES = min_bytes
        rank_receiver.SPLIT_WRITE_WINDOW_S = write_window_s  # a decode side's ack names it
        self.split = True

    def endpoint(self) -> Any:
        if self.host is None:
            self.host = ChannelHost()
        return self.host.endpoint

    def recv(self, name: str, ticket: Any, rank: int, num_kv_heads: int) -> None:
        assert self.host is not None
        if self.split:
            key = (num_kv_heads, ticket.decode_tp_size, rank)
            if key not in self.receivers:
                cache = KVCache(rank_spec(num_kv_heads, ticket.decode_tp_size, rank))
                self.receivers[key] = KVRankReceiver(
                    cache, self.host, rank, num_kv_heads, export_now=True
                )
            receiver = self.receivers[key]
            receiver.cache.data[:, :, :, list(ticket.block_ids)] = 0  # what an earlier one left
            self.handles[name] = (receiver.receive(ticket), receiver.cache)
            return
        cache = KVCache(rank_spec(num_kv_heads, ticket.decode_tp_size, rank))
        handle = KVRankReceiver(cache, self.host, rank, num_kv_heads).receive(ticket)
        self.handles[name] = (handle, cache)

    def send(
        self,
        name: str,
        ticket: Any,
        rank: int,
        num_kv_heads: int,
        seed: int,
        src_block_ids: list[int],
        first_token_id: int | None,
        num_layers_to_send: int | None,
    ) -> None:
        # One cache per rank shape, as a prefill rank has: the same-node transport exports it
        # once per channel. Only this transfer's source blocks take the seed's KV.
        key = (num_kv_heads, ticket.prefill_tp_size, rank)
        if key not in self.senders:
            cache = KVCache(rank_spec(num_kv_heads, ticket.prefill_tp_size, rank))
            self.senders[key] = KVRankSender(cache, self.dialer, rank, num_kv_heads)
        sender = self.senders[key]
        cache = sender.cache
        source = source_cache(seed, num_kv_heads, ticket.prefill_tp_size, rank).data
        cache.data[:, :, :, src_block_ids] = source[:, :, :, src_block_ids]
        handle = sender.start(ticket, src_block_ids)
        if ticket.layerwise:
            for layer in range(
                num_layers_to_send if num_layers_to_send is not None else NUM_LAYERS
            ):
                handle.send_layer(layer)
        if num_layers_to_send is None:
            handle.finish(first_token_id)
        self.handles[name] = (handle, cache)

    def split_then_vanish(
        self, name: str, ticket: Any, rank: int, num_kv_heads: int, src_block_ids: list[int]
    ) -> float:
        """A prefill rank that sends a split M1, takes the decode side's ack and then drops the
        channel without writing its share or reporting (as one that dies mid-split would).
        Returns when it sent M1 (time.monotonic)."""
        key = (num_kv_heads, ticket.prefill_tp_size, rank)
        if key not in self.senders:
            cache = KVCache(rank_spec(num_kv_heads, ticket.prefill_tp_size, rank))
            self.senders[key] = KVRankSender(cache, self.dialer, rank, num_kv_heads)
        handle = self.senders[key].start(ticket, src_block_ids)
        lane = handle._lanes[0]
        sent_at = time.monotonic()
        handle._post_same_node_end(lane, 0, 0, 0)  # M1 (status OK) with its split
        assert lane.split > 0 and lane.channel is not None and lane.outgoing is not None
        deadline = time.monotonic() + 10.0
        lane.channel.wait(lane.outgoing.wait_reply(deadline), deadline, "ack")
        lane.channel.close()
        self.handles[name] = (handle, None)
        return sent_at

    def split_channels(self) -> bool:
        """Whether channels made here put control and KV on two groups (SPLIT_GROUPS_ENV)."""
        probe = Channel("probe", 0, torch.distributed.HashStore(), 0, torch.device("cpu"))
        return probe.split

    def same_node(self, name_prefix: str) -> list[bool]:
        """Whether each of this rank's channels for an instance pair uses the same-node
        transport (none when the plan gives this rank nothing to send)."""
        return [c.same_node for c in self.dialer._channels.values() if name_prefix in c.pair_key]

    def cancel(self, name: str, ticket: Any, rank: int, num_kv_heads: int) -> None:
        """End a transfer that never started: a CANCELLED header only."""
        cache = KVCache(rank_spec(num_kv_heads, ticket.prefill_tp_size, rank))
        sender = KVRankSender(cache, self.dialer, rank, num_kv_heads)
        self.handles[name] = (sender.cancel_unstarted(ticket), cache)

    def cancel_started(self, name: str) -> None:
        """Cancel a send that started (the rest goes with a CANCELLED trailer)."""
        handle, _ = self.handles[name]
        handle.cancel()

    def wait(self, name: str, check: tuple[Any, ...] | None) -> dict[str, Any]:
        handle, cache = self.handles.pop(name)
        try:
            if isinstance(handle, RecvHandle):
                received = handle.wait(COMMAND_TIMEOUT_S)
                result: dict[str, Any] = {"ok": True, "first_token_id": received.first_token_id}
                # The trailer's stamp: when the sender finished (its clock is this machine's).
                stamped = received.first_token_at
                result["stamped_s_ago"] = None if stamped is None else time.time() - stamped
                if check is not None:
                    result["mismatch"] = check_received(cache, *check, only_dst=self.split)
                return result
            assert isinstance(handle, SendHandle)
            handle.wait(COMMAND_TIMEOUT_S)
            # how many blocks this side wrote into each lane's decode cache (same-node split)
            return {"ok": True, "written": handle.blocks_written()}
        except Exception as exc:
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}
        finally:
            if isinstance(handle, RecvHandle):
                self.ended[name] = handle.finished_at

    def ended_at(self, name: str) -> float | None:
        """When a waited receive ended on this rank (time.monotonic, one clock per machine)."""
        return self.ended.get(name)


def _worker_main(
    commands: Any, replies: Any, rank: int, world: int, group_port: int | None
) -> None:
    torch.set_num_threads(1)
    if group_port is not None:  # the worker's own TP group, which the channels must not disturb
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=rank, world_size=world
        )
    from tests.kv_transfer.kv_instances import InstanceState  # it builds on this module

    state = InstanceState()
    replies.put(("ok", "ready"))
    while True:
        try:
            command = commands.get(timeout=COMMAND_TIMEOUT_S * 2)
        except queue.Empty:
            os._exit(3)  # the parent is gone; never linger
        name, args = command[0], command[1:]
        if name == "exit":
            break
        try:
            if name == "all_reduce":
                value = torch.tensor([float(args[0])])
                dist.all_reduce(value)
                replies.put(("ok", value.item()))
            elif name == "endpoint":
                replies.put(("ok", state.endpoint()))
            else:
                replies.put(("ok", getattr(state, name)(*args)))
        except Exception:
            replies.put(("error", traceback.format_exc()))
    os._exit(0)  # skip teardown of groups whose peers may be gone
