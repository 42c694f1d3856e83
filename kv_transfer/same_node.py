"""The same-node transport: the decode rank copies the KV straight out of the prefill rank's
cache, through memory both processes map, instead of receiving it through a socket.

    prefill rank                                decode rank
    before serving: export the cache           the channel's first transfer: map it
      CPU: move it to shared memory (in place,    CPU: the same pages, through
           once); hand out its descriptor              /proc/<pid>/fd/<fd>
      GPU: a CUDA IPC handle                      GPU: a CUDA IPC mapping of the same memory
    per transfer, on the pair's gloo channel (one ordered stream, streams.py), one message:
      at finish: header, trailer, source ids    OK -> copy source blocks (their heads) into
                                                  the reserved blocks, one copy
                                                  (device to device on GPU), then report
The source blocks stay referenced by the prefill instance until the decode side acks (KVSender),
so they cannot change while the copy reads them. Control messages are CPU tensors on gloo even
on GPU: NCCL refuses two ranks on one device, which one GPU shared by a prefill and a decode
process is. Which transport a pair uses: tickets carry KVTransferConfig.transport; "auto" picks
this one when the decode rank's endpoint names this node.
"""

from __future__ import annotations

import os
import pickle
import socket
import uuid
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from engine.kv_cache import KVCache
from kv_transfer.errors import KVTransferError
from kv_transfer.wire import CONTROL_LEN, WireView


def _node_id() -> str:
    """This machine: its host name and boot id (two containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


NODE_ID = _node_id()
_MAX_CUDA_RUN_COPIES = 32


def uses_same_node(transport: str, decode_node_id: str) -> bool:
    """Whether a pair whose decode rank runs on `decode_node_id` takes this transport."""
    if transport == "same_node":
        return True
    return transport == "auto" and decode_node_id == NODE_ID


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
    return pickle.dumps(("cpu", token, (os.getpid(), fd, size), layout))


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
    (pid, fd, size), (dtype, shape, stride, offset) = rest
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as exc:
        raise KVTransferError(f"the prefill rank's cache cannot be mapped: {exc}") from exc
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(opened, size)  # type: ignore[attr-defined]
    finally:
        os.close(opened)  # the mapping stays
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


# The same-node transport's one message per transfer, sent when the prompt is done (int64):
#   header (CONTROL_LEN) | trailer (CONTROL_LEN) | copy-by (ns, CLOCK_MONOTONIC) | source block ids
# The decode side's reader posts a receive this long for the most ids a transfer can carry (gloo
# takes a shorter message into a longer receive: a header alone, for a cancel), so a transfer
# needs no second round trip after its header. Control always goes over gloo, even on GPU.
_END_FIXED = 2 * CONTROL_LEN + 1


def end_message_len(max_block_ids: int) -> int:
    """Length of the receive that takes any same-node message of up to `max_block_ids` ids."""
    return _END_FIXED + max_block_ids


def end_message(
    header: torch.Tensor, trailer: torch.Tensor, copy_by_ns: int, src_block_ids: Sequence[int]
) -> torch.Tensor:
    """The one message that ends a same-node transfer: its header, trailer, until when the
    source blocks are held (see KVSender: they are freed a grace period after the deadline),
    and where to copy from."""
    tail = torch.tensor([copy_by_ns, *src_block_ids], dtype=torch.int64)
    return torch.cat([header.cpu(), trailer.cpu(), tail])


def parse_end_message(
    message: torch.Tensor, num_block_ids: int
) -> tuple[list[int], int, list[int]]:
    """(trailer values, copy-by ns, source block ids) of a message whose header was checked."""
    values = message[: _END_FIXED + num_block_ids].tolist()
    trailer = values[CONTROL_LEN : 2 * CONTROL_LEN]
    return trailer, values[2 * CONTROL_LEN], values[_END_FIXED:]


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
    source: torch.Tensor, src_heads: slice, src_block_ids: list[int], view: WireView
) -> None:
    """Copy the source blocks' `src_heads` into `view`'s blocks and heads, in one pass: a
    strided copy per stretch of ids that run on together on both sides (one when both are
    runs). Even with every block its own stretch this beats a gather and a scatter, which go
    through a temporary: 14 against 44 ms for 512 scattered blocks of the benchmark's shape on
    one core, where one contiguous copy of the same bytes takes 11. On a GPU, where each copy
    is a kernel launch, many stretches take one gather and one scatter instead."""
    dst_data = view.cache.data
    if source.dtype != dst_data.dtype or source.shape[4:] != dst_data.shape[4:]:
        raise KVTransferError(
            f"the prefill rank's cache holds {source.dtype} blocks {tuple(source.shape[4:])} and "
            f"this one {dst_data.dtype} {tuple(dst_data.shape[4:])}: set the same kv_cache.dtype"
        )
    src = source[:, :, src_heads]  # [L, 2, heads, blocks, block_size, head_dim]
    dst = view.cache.data[:, :, view.heads]
    runs = paired_runs(src_block_ids, list(view.block_ids))
    if source.is_cuda and len(runs) > _MAX_CUDA_RUN_COPIES:
        src_index = torch.tensor(src_block_ids, dtype=torch.long, device=source.device)
        dst_index = torch.tensor(view.block_ids, dtype=torch.long, device=source.device)
        dst.index_copy_(3, dst_index, src.index_select(3, src_index))
    else:
        for src_start, dst_start, length in runs:
            dst.narrow(3, dst_start, length).copy_(src.narrow(3, src_start, length))
    if source.is_cuda:  # the blocks are whole before the decode side reports them landed
        torch.cuda.current_stream(source.device).synchronize()
