"""The paged KV cache tensor and its layout: the one place that knows how KV sits in memory.

One preallocated tensor per worker (per TP rank), never grown:

    data: [num_layers, 2, num_kv_heads_local, num_blocks, block_size, head_dim]
                       ^ 0 = key, 1 = value

Token t of a sequence lives in block `block_table[t // block_size]` at offset `t % block_size`; its
flat slot is `block_id * block_size + offset` (the slot mapping).

Heads outermost (head-major, like FlashInfer's HND but with the head above the block): one KV
head's keys or values for a run of consecutive blocks are one contiguous region. That is what
the KV hand-off needs: a decode rank with another TP size than the prefill rank takes a subset of
its heads, and with heads outermost each head of a block run travels straight from the sending
cache into the receiving one, with no copy on either side (gloo and NCCL send only contiguous
tensors; with heads innermost, as flash-attn's [blocks, block_size, heads, head_dim], every
head slice is a strided gather of head_dim-sized pieces). It also suits attention on CPU: a
gather of a sequence's blocks per head is already SDPA's [heads, seq, head_dim].
`paged_view` gives the [num_blocks, block_size, heads, head_dim] strided view paged kernels
such as flash-attn's take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def local_kv_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The global KV head ids that TP rank `tp_rank` holds.

    With tp_size <= num_kv_heads the heads are split evenly (tp_size must divide them).
    With tp_size > num_kv_heads each head is replicated on tp_size // num_kv_heads consecutive
    ranks (num_kv_heads must divide tp_size), so every rank holds exactly one KV head.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide num_key_value_heads {num_kv_heads}"
            )
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads {num_kv_heads} must divide tensor_parallel_size {tp_size} "
            "when the heads are replicated"
        )
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # heads held by this rank (see local_kv_heads)
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_layers,
            2,
            self.num_kv_heads,
            self.num_blocks,
            self.block_size,
            self.head_dim,
        )

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * elem
        return max(0, budget_bytes // per_block)


class KVCache:
    """The KV tensor of one worker rank. Only the model runner and kv_transfer touch it."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        # zeros, not empty: a bug that reads an unwritten slot then gives zeros, not NaN garbage
        self.data = torch.zeros(spec.shape, dtype=spec.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def key(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [num_kv_heads, num_blocks, block_size, head_dim]

    def value(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]


def paged_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_kv_heads, num_blocks, block_size, head_dim] -> the same memory viewed as
    [num_blocks, block_size, num_kv_heads, head_dim] (strided; no copy)."""
    return cache.permute(1, 2, 0, 3)
