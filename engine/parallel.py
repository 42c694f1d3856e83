"""Tensor parallelism: the TP process group, its collectives, and the layers that shard over it.

Each TP rank is one process. Its TP group is by default the process's default torch.distributed
group (NCCL on CUDA, gloo on CPU). All collectives go through the helpers below, so swapping the
group (e.g. a subgroup of a larger world) is one `set_tp_group` call. With tp_size == 1 every
collective is a no-op and no process group is needed.

Layers own their weight shards and know how to load them: `weight_loader(param, source, shard_id)`
receives a safetensors slice (or a full tensor) of the checkpoint tensor and copies only this
rank's part into `param`; with safetensors slices only that part is read from disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from engine.cpu_linear import linear
from engine.kv_cache import local_kv_heads
from engine.net import create_store

_TP_GROUP: dist.ProcessGroup | None = None
# gloo group over the same ranks for pickled control messages (the TP group itself on CPU)
_CONTROL_GROUP: dist.ProcessGroup | None = None
_TP_RANK = 0
_TP_SIZE = 1
_TP_STORE: dist.Store | None = None


def backend_for_device(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tp_group(
    tp_rank: int,
    tp_size: int,
    master_port: int,
    device: str | torch.device = "cpu",
    timeout_s: float = 60.0,
    master_addr: str = "127.0.0.1",
    op_timeout_s: float | None = None,
) -> None:
    """Join the TP group as `tp_rank` (rank 0 hosts the TCPStore). Blocks until all ranks join
    (at most `timeout_s`); afterwards each collective waits at most `op_timeout_s` for its peers
    (default `timeout_s`). Steps reach the other ranks through `tp_step_queue()`, not a
    collective, so an idle group never meets that deadline."""
    global _TP_STORE
    if tp_size > 1:
        store = create_store(master_addr, master_port, tp_size, tp_rank == 0, timeout_s)
        dist.init_process_group(
            backend_for_device(device),
            store=store,
            rank=tp_rank,
            world_size=tp_size,
            timeout=timedelta(seconds=timeout_s),
        )
        group = dist.group.WORLD
        control = group if backend_for_device(device) == "gloo" else dist.new_group(backend="gloo")
        if op_timeout_s is not None:  # formed under the start-up deadline; steps use their own
            for each in {group, control}:
                _set_pg_timeout(timedelta(seconds=op_timeout_s), each)
        set_tp_group(group, tp_rank, tp_size, control)
        _TP_STORE = store
    else:
        set_tp_group(None, 0, 1)


def set_tp_group(
    group: dist.ProcessGroup | None,
    tp_rank: int,
    tp_size: int,
    control_group: dist.ProcessGroup | None = None,
) -> None:
    """Make `group` the TP group of this process (`control_group`: gloo, same ranks)."""
    global _TP_GROUP, _CONTROL_GROUP, _TP_RANK, _TP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE = group, tp_rank, tp_size
    _CONTROL_GROUP = control_group if control_group is not None else group


@contextmanager
def without_tp() -> Iterator[None]:
    """Inside: this process alone, as at TP size 1 (a draft model that is not sharded, beside
    a TP target on its driver rank); the TP group is back afterwards."""
    saved = (_TP_GROUP, _TP_RANK, _TP_SIZE, _CONTROL_GROUP)
    set_tp_group(None, 0, 1)
    try:
        yield
    finally:
        set_tp_group(saved[0], saved[1], saved[2], saved[3])


def destroy_tp_group() -> None:
    global _TP_STORE
    if _TP_SIZE > 1 and dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(None, 0, 1)
    _TP_STORE = None


def tp_store() -> dist.Store:
    """The TP group's rendezvous store (hosted by rank 0): steps and liveness go through it."""
    if _TP_STORE is None:
        raise RuntimeError("no TP group with a store in this process (init_tp_group first)")
    return _TP_STORE


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group, in place."""
    if _TP_SIZE > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim (rank order)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def tp_all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (any picklable), in rank order, on every rank (gloo control group)."""
    if _TP_SIZE == 1:
        return [obj]
    gathered: list[Any] = [None] * _TP_SIZE
    dist.all_gather_object(gathered, obj, group=_CONTROL_GROUP)
    return gathered


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


def _new_param(*shape: int) -> nn.Parameter:
    # Allocated in the default dtype/device of the build context; filled by the loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(param: torch.Tensor, loaded: Any) -> None:
    """Copy a checkpoint slice into a param (view), checking the shape."""
    tensor = loaded if isinstance(loaded, torch.Tensor) else torch.as_tensor(loaded)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    param.copy_(tensor)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over ranks; each rank returns its output slice."""

    packed_weight: torch.Tensor | None = None  # W reordered for oneDNN (engine/cpu_linear.py)

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        # output_sizes: the global sizes of the parts fused into this weight (one for a plain layer)
        self.local_sizes = [divide(size, tp_size(), "output size") for size in output_sizes]
        self.weight = _new_param(sum(self.local_sizes), input_size)
        self.bias = _new_param(sum(self.local_sizes)) if bias else None
        self._register_loader()

    def _register_loader(self) -> None:
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                param.num_shards = len(self.local_sizes)  # type: ignore[attr-defined]

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in the local param, start row in the checkpoint tensor, number of rows)."""
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), tp_rank() * size, size

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        offset, start, size = self.shard_rows(shard_id)
        _copy(param.narrow(0, offset, size), loaded[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers on the same input in one weight (gate and up projections)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused; shard ids 0/1/2. KV heads per rank follow `local_kv_heads`."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.num_local_heads = divide(num_heads, tp_size(), "num_attention_heads")
        self.kv_head_ids = local_kv_heads(num_kv_heads, tp_size(), tp_rank())
        kv_size = len(self.kv_head_ids) * head_dim
        # the q part is an ordinary column split; k/v are overridden in shard_rows
        super().__init__(
            hidden_size, [num_heads * head_dim, kv_size * tp_size(), kv_size * tp_size()], bias
        )
        self.head_dim = head_dim

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        offset = sum(self.local_sizes[:shard_id])
        if shard_id == 0:
            return offset, tp_rank() * self.local_sizes[0], self.local_sizes[0]
        # k or v: possibly a replicated head, so start from the global head id, not the rank
        return offset, self.kv_head_ids.start * self.head_dim, self.local_sizes[shard_id]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over ranks; partial sums all-reduced."""

    packed_weight: torch.Tensor | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.local_input_size = divide(input_size, tp_size(), "input size")
        self.weight = _new_param(output_size, self.local_input_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = _new_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda param, loaded, shard_id=0: _copy(param, loaded[:])  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        start = tp_rank() * self.local_input_size
        _copy(param, loaded[:, start : start + self.local_input_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(linear(x, self.weight, None, self.packed_weight))
        # the bias is added once, after the reduction
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks in contiguous vocab ranges (the vocab padded to tp_size)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_local_rows = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.num_local_rows
        # rows past vocab_size (padding on the last rank) stay zero
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.num_local_rows))
        self.weight = _new_param(self.num_local_rows, hidden_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        param.zero_()
        rows = loaded[self.vocab_start : self.vocab_start + self.num_real_rows]
        _copy(param.narrow(0, 0, self.num_real_rows), rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local_rows)
        embedded = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; every rank gets full-vocab logits."""

    packed_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local_logits = linear(
            hidden, self.weight, None, self.packed_weight
        )  # [num_tokens, num_local_rows]
        return tp_all_gather_last_dim(local_logits)[..., : self.vocab_size]
