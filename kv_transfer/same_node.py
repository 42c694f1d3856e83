"""The same-node transport: the two ranks copy the KV straight between their caches, through
memory both processes map, instead of sending it through a socket.

    prefill rank                                decode rank
    before serving: export the cache           before serving (CPU): export the cache too
      CPU: move it to shared memory (in place,    (shared memory), and publish it with each
           once); hand out its descriptor         new channel (rendezvous.py)
      GPU: a CUDA IPC handle                      the channel's first transfer: map the
                                                  prefill's cache (CPU: /proc/<pid>/fd/<fd>;
                                                  GPU: a CUDA IPC mapping of the same memory)
    per transfer, on the pair's gloo channel (one ordered stream, streams.py):
      at finish: M1 = header, trailer, copy-by,  M1 -> copy its share of the source blocks
        split, source ids                            (their heads) into the reserved blocks
      split > 0 (CPU, both caches exported):       split > 0: ack M1 first (with a write-by),
        wait for the ack, copy the first `split`   then copy blocks [split:], then wait for M2
        blocks into the decode's reserved ones   M2 says how many of the first `split` the
        (none started past write-by), then M2        prefill wrote; copy what it did not
        = how many it wrote                       -> report landed
The source blocks stay referenced by the prefill instance until the decode side acks (KVSender),
so they cannot change while a copy reads them. The split puts both processes' cores on a large
copy: on CPU a memcpy is the whole cost, and the network path also spends both sides' cores (a
kernel copy on each). The prefill side writes into the decode's blocks only after the decode's
reader acked M1: from then on the decode side owns the transfer (no withdrawal at the deadline),
and it releases the blocks only after M2 or, if M2 never comes, after the write-by its ack named
(the prefill side starts no copy past it; it is never past copy-by, so the source blocks are
still held while the prefill side reads them). On GPU the copy is one device-to-device copy either way: no split.
Control messages are CPU tensors on gloo even on GPU: NCCL refuses two ranks on one device,
which one GPU shared by a prefill and a decode process is. Which transport a pair uses: tickets
carry KVTransferConfig.transport; "auto" picks this one when the decode rank's endpoint names
this node and, on GPU, the GPUs it sees include the prefill rank's (`pair_transport`).
"""

from __future__ import annotations

import os
import pickle
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import reduce_tensor

from engine.kv_cache import KVCache
from kv_transfer.errors import KVTransferError
from kv_transfer.wire import CONTROL_LEN, WireView, int64_tensor


def _node_id() -> str:
    """This machine as the processes here see it: its host name, boot id (two containers may
    share a host name) and PID namespace (two containers on host networking share both, but not
    /proc/<pid>, through which a CPU cache is mapped)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    try:
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = ""
    return f"{socket.gethostname()}/{boot_id}/{pid_namespace}"


NODE_ID = _node_id()
_MAX_CUDA_RUN_COPIES = 32


def visible_gpus(device: torch.device) -> tuple[str, ...]:
    """The UUIDs of every GPU a process whose cache is on `device` can map memory of: the ones
    it sees (CUDA_VISIBLE_DEVICES, a Ray actor's GPU ids); none for a CPU cache."""
    if device.type != "cuda":
        return ()
    return tuple(
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    )


def cache_gpu(device: torch.device) -> str | None:
    """The UUID of the GPU a cache on `device` lives on (None on CPU): names it across processes
    that number the node's GPUs differently."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def pair_transport(
    transport: str,
    decode_node_id: str,
    decode_gpus: Sequence[str],
    source_gpu: str | None,
    local_node_id: str = NODE_ID,
) -> str:
    """ "same_node" or "network" for the pair of a prefill rank on `local_node_id`, whose cache
    is on GPU `source_gpu` (None: CPU), and a decode rank on `decode_node_id` that sees
    `decode_gpus`. Decided once per channel (KVRankSender), never per transfer.

    The decode rank maps the prefill rank's cache, so on GPU it must see that GPU: a runtime that
    gives each worker only its own GPU (plain processes with CUDA_VISIBLE_DEVICES per worker, a
    Ray actor with num_gpus=1) makes two GPUs of one node unmappable to each other. Such a pair
    goes over NCCL under "auto"; "same_node" there is a configuration error, said at once."""
    if transport == "network":
        return "network"
    if transport == "auto" and decode_node_id != local_node_id:
        return "network"
    if source_gpu is not None and source_gpu not in decode_gpus:
        if transport == "same_node":
            raise KVTransferError(
                f"kv_transfer.transport is same_node, but the decode rank cannot see GPU "
                f"{source_gpu}, which holds the prefill rank's cache (it sees "
                f"{', '.join(decode_gpus) or 'none'}): set transport auto or network, or make "
                "the node's GPUs visible to both workers"
            )
        return "network"
    return "same_node"


def export_cache(cache: KVCache) -> bytes:
    """A handle another process on this node maps the cache's memory with (see `map_cache`).

    Each export carries a token of its own: the descriptor's (pid, fd) pair is reused once an
    exporter in the same process is gone, and a handle must never name an earlier cache."""
    data = cache.data
    token = uuid.uuid4().hex
    if data.is_cuda:
        rebuild, args = reduce_tensor(data)
        gpu = str(torch.cuda.get_device_properties(data.device).uuid)
        return pickle.dumps(("cuda", token, gpu, rebuild, args))
    # In place: the model's views of the cache keep working. By file descriptor, which the
    # peer opens through /proc: torch's file-name sharing would start torch_shm_manager, a
    # process that inherits this one's sockets and so hides its death from every peer.
    data.share_memory_()
    fd, size = data.untyped_storage()._share_fd_cpu_()
    layout = (data.dtype, tuple(data.shape), data.stride(), data.storage_offset())
    stat = os.fstat(fd)  # the peer checks that /proc/<pid>/fd/<fd> opens this very file
    file_id = (stat.st_dev, stat.st_ino)
    return pickle.dumps(("cpu", token, (os.getpid(), fd, size, file_id), layout))


# Where torch's CUDA IPC rebuild arguments name the exporter's device index (reduce_tensor).
_CUDA_DEVICE_ARG = 6


def _local_device_index(gpu_uuid: str) -> int:
    """This process's index for the GPU the exporter named by UUID: CUDA_VISIBLE_DEVICES may
    number the same GPU differently in the two processes."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == gpu_uuid:
            return index
    raise KVTransferError(
        f"the prefill rank's cache is on GPU {gpu_uuid}, which this process cannot see; "
        "set kv_transfer.transport: network for this pair"
    )


def map_cache(handle: bytes) -> torch.Tensor:
    """The exporting rank's cache data, mapped into this process. The caller keeps the mapping
    (a channel holds it for its life: Channel.mapped_source) and drops it to unmap."""
    kind, _token, *rest = pickle.loads(handle)  # noqa: S301 - from our own peer's rendezvous store
    if kind == "cuda":
        gpu, rebuild, args = rest
        args = list(args)
        args[_CUDA_DEVICE_ARG] = _local_device_index(gpu)
        return rebuild(*args)
    (pid, fd, size, file_id), (dtype, shape, stride, offset) = rest
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as exc:
        raise KVTransferError(f"the peer rank's cache cannot be mapped: {exc}") from exc
    stat = os.fstat(opened)
    if (stat.st_dev, stat.st_ino) != tuple(file_id):  # another process's file under that pid
        os.close(opened)
        raise KVTransferError(
            f"/proc/{pid}/fd/{fd} is not the peer rank's cache here (the two processes do not "
            "share a PID namespace); set kv_transfer.transport: network for this pair"
        )
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(opened, size)  # type: ignore[attr-defined]
    finally:
        os.close(opened)  # the mapping stays
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


# The same-node transport's first message per transfer, sent when the prompt is done (int64):
#   header (CONTROL_LEN) | trailer (CONTROL_LEN) | copy-by (ns) | split | ids
# (times on CLOCK_MONOTONIC, one clock on one node). `split`: how many leading blocks the prefill
# side writes itself after the decode side's ack (0: the decode side copies them all, no ack and
# no M2). The decode side's reader posts a receive this long for the most ids a transfer can
# carry (gloo takes a shorter message into a longer receive: a header alone, for a cancel), so a
# transfer needs no second round trip after its header. Control always goes over gloo.
_END_FIXED = 2 * CONTROL_LEN + 2
# The decode side's ack of a split M1, a control message (transfer id, answer, write-by ns): write
# your share, starting no copy past write-by; write nothing, the source blocks' hold ended (the
# transfer is cancelled); write nothing, this side copies them all (the channel's published cache
# is not the one this transfer lands in).
ACK_WRITE, ACK_LATE, ACK_COPY_ALL = 0, 1, 2
# Write-by is this long after the ack (and never past copy-by): one copy takes milliseconds.
SPLIT_WRITE_WINDOW_S = 1.0


def end_message_len(max_block_ids: int) -> int:
    """Length of the receive that takes any same-node message of up to `max_block_ids` ids."""
    return _END_FIXED + max_block_ids


@dataclass(frozen=True)
class SameNodeEnd:
    """A parsed M1 (see `end_message`)."""

    trailer: list[int]
    copy_by_ns: int  # the source blocks are held until then (KVSender frees them a grace later)
    split: int  # the prefill side writes blocks [0, split) itself, after the ack
    src_block_ids: list[int]


def end_message(
    header: torch.Tensor,
    trailer: torch.Tensor,
    copy_by_ns: int,
    src_block_ids: Sequence[int],
    split: int = 0,
) -> torch.Tensor:
    """M1, the message that ends a same-node transfer's prefill: its header, trailer, until
    when the source blocks are held (see KVSender: they are freed a grace period after the
    deadline), how many leading blocks the prefill side writes itself, and where to copy from."""
    tail = torch.tensor([copy_by_ns, split, *src_block_ids], dtype=torch.int64)
    return torch.cat([header.cpu(), trailer.cpu(), tail])


def parse_end_message(message: torch.Tensor, num_block_ids: int) -> SameNodeEnd:
    """M1's fields, for a message whose header was checked."""
    values = message[: _END_FIXED + num_block_ids].tolist()
    fixed = 2 * CONTROL_LEN
    return SameNodeEnd(
        trailer=values[CONTROL_LEN:fixed],
        copy_by_ns=values[fixed],
        split=values[fixed + 1],
        src_block_ids=values[_END_FIXED:],
    )


def paired_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) for each stretch where both sides' ids run on together."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_blocks(
    source: torch.Tensor,
    src_heads: slice,
    src_block_ids: Sequence[int],
    dest: torch.Tensor,
    dst_heads: slice,
    dst_block_ids: Sequence[int],
) -> None:
    """Copy the source blocks' `src_heads` into `dest`'s blocks and heads (both whole cache
    tensors, [L, 2, heads, blocks, ...]), in one pass: a strided copy per stretch of ids that run
    on together on both sides (one when both are runs). Even with every block its own stretch
    this beats a gather and a scatter, which go through a temporary: 14 against 44 ms for 512
    scattered blocks of the benchmark's shape on one core, where one contiguous copy of the same
    bytes takes 11. On a GPU, where each copy is a kernel launch, many stretches take one gather
    and one scatter instead."""
    if source.dtype != dest.dtype or source.shape[4:] != dest.shape[4:]:
        raise KVTransferError(
            f"the prefill rank's cache holds {source.dtype} blocks {tuple(source.shape[4:])} and "
            f"the decode rank's {dest.dtype} {tuple(dest.shape[4:])}: set the same kv_cache.dtype"
        )
    src = source[:, :, src_heads]  # [L, 2, heads, blocks, block_size, head_dim]
    dst = dest[:, :, dst_heads]
    runs = paired_runs(list(src_block_ids), list(dst_block_ids))
    if source.is_cuda and len(runs) > _MAX_CUDA_RUN_COPIES:
        # each index on its own tensor's device: the mapped source may be another GPU
        src_index = int64_tensor(src_block_ids, source.device)
        dst_index = int64_tensor(dst_block_ids, dest.device)
        gathered = src.index_select(3, src_index).to(dest.device)
        dst.index_copy_(3, dst_index, gathered)
    else:
        for src_start, dst_start, length in runs:
            dst.narrow(3, dst_start, length).copy_(src.narrow(3, src_start, length))
    # The blocks are whole before the decode side reports them landed: a copy between two GPUs
    # runs on both devices' current streams.
    for device in {source.device, dest.device}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def copy_into_view(
    source: torch.Tensor, src_heads: slice, src_block_ids: Sequence[int], view: WireView
) -> None:
    """The decode side's copy: the source blocks into `view`'s blocks and heads."""
    copy_blocks(source, src_heads, src_block_ids, view.cache.data, view.heads, view.block_ids)
