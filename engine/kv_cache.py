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

A quantized cache (`kv_dtype` "fp8_e4m3" or "int8", engine/kv_quant.py) is uint8 with each
head's block as one region of values and its scale: [..., num_blocks, block_bytes].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_quant import KVQuantFormat, quant_format


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
    dtype: torch.dtype  # the model's (compute) dtype
    kv_dtype: str = "auto"  # how the cache stores KV: engine.kv_quant.KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        quant_format(self.kv_dtype, self.block_size, self.head_dim)  # checks the name

    @property
    def quant(self) -> KVQuantFormat | None:
        """The quantized block format, or None when KV is stored at the model's dtype."""
        return quant_format(self.kv_dtype, self.block_size, self.head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: the model's, or uint8 when quantized."""
        return self.dtype if self.kv_dtype == "auto" else torch.uint8

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One KV head's share of one block, in storage_dtype elements."""
        quant = self.quant
        return (self.block_size, self.head_dim) if quant is None else (quant.block_bytes,)

    @property
    def head_block_bytes(self) -> int:
        """The bytes of one (layer, k/v, head, block) region, scales included."""
        count = 1
        for size in self.block_shape:
            count *= size
        return count * self.storage_dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, *self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_block_bytes

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
    ) -> int:
        spec = KVCacheSpec(num_layers, 1, block_size, num_kv_heads, head_dim, dtype, kv_dtype)
        return max(0, budget_bytes // spec.bytes_per_block)


class KVCache:
    """The KV tensor of one worker rank. Only the model runner and kv_transfer touch it."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        # zeros, not empty: a bug that reads an unwritten slot then gives zeros, not NaN garbage
        self.data = torch.zeros(spec.shape, dtype=spec.storage_dtype, device=device)
        self.quant = spec.quant  # None: KV at the model's dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def key(self, layer: int) -> torch.Tensor:
        # [num_kv_heads, num_blocks, block_size, head_dim]; quantized: [.., num_blocks, block_bytes]
        return self.data[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]


def paged_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_kv_heads, num_blocks, block_size, head_dim] -> the same memory viewed as
    [num_blocks, block_size, num_kv_heads, head_dim] (strided; no copy)."""
    return cache.permute(1, 2, 0, 3)
