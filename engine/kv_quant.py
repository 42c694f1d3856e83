"""8-bit KV cache: the block layout, the one write path that quantizes, and dequantization.

`kv_cache.dtype` is "auto" (KV at the model's dtype), "fp8_e4m3" or "int8". A quantized cache
stores, per (layer, k/v, KV head, block), one byte per element and that block's float32 scale,
side by side in one uint8 region (KVCacheSpec.block_shape = (block_bytes,)):

    [ block_size * head_dim values (int8 / float8_e4m3fn bytes), padded to 4 | float32 scale ]

value = stored * scale; scale = the block's max |x| / QMAX (127 for int8, 448 for e4m3). A
scale per block and head, not per token: 4 bytes per block_size * head_dim values keeps the
cache at ~1/4 of float32 (3.98x the blocks per GB at 16 x 64; a float32 scale per token would
cost 6% more, under 3.8x). Because the scale sits inside its block and head, everything that
moves blocks (the wire, the same-node copy, TP re-sharding by heads, the prefix cache) moves
the scales with them without knowing they are there.

Writes (prefill, chunked prefill and decode alike: `KVQuantFormat.write`): a write that starts a
block (offset 0) starts its scale afresh; a later write whose values exceed the scale grows it
and requantizes the block's earlier entries to the new scale. Scales only grow within a block,
so no value is ever clipped. Reads dequantize the gathered blocks to the compute dtype
(`dequantize`); every attention reads the cache, a prompt's first chunk included, so a prefix
hit or another chunking attends to what a miss does. docs/design/kv-quantization.md gives the
reasoning and the measured quality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
SCALE_BYTES = 4  # one float32 per (layer, k/v, head, block)
_QDTYPE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
# fp8: a block that a write leaves partly filled gets 4x its rows' scale, so that a decode
# step's new row seldom grows it (each growth requantizes the block). e4m3 keeps 3 mantissa bits
# at any magnitude, so the room costs only values under 2**-6 * 4 / 448 of the block's maximum
# (they turn subnormal); int8 would lose a bit per doubling, so it gets none.
_HEADROOM = {"fp8_e4m3": 4.0}
_TINY = torch.finfo(torch.float32).tiny  # a scale never 0: an all-zero block divides by it


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}"
        )
    return kv_cache_dtype


@dataclass(frozen=True)
class KVQuantFormat:
    """How one quantized cache's blocks hold their values and scales (see the module doc)."""

    kind: str  # "int8" or "fp8_e4m3"
    block_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in _QDTYPE:
            raise ValueError(f"not a quantized kv_cache dtype: {self.kind!r}")

    @property
    def qdtype(self) -> torch.dtype:
        return _QDTYPE[self.kind]

    @property
    def qmax(self) -> float:
        return _QMAX[self.kind]

    @property
    def values_bytes(self) -> int:
        """The values' bytes in one block of one head, padded so the scale is 4-aligned."""
        return -(-self.block_size * self.head_dim // SCALE_BYTES) * SCALE_BYTES

    @property
    def block_bytes(self) -> int:
        return self.values_bytes + SCALE_BYTES

    def split(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., block_bytes] uint8 -> views of its values [..., block_size, head_dim] (uint8)
        and its scales [...] (float32), sharing the cache's memory."""
        num_values = self.block_size * self.head_dim
        values = cache[..., :num_values].unflatten(-1, (self.block_size, self.head_dim))
        scale_bytes = cache[..., self.values_bytes : self.block_bytes]
        return values, scale_bytes.view(torch.float32).squeeze(-1)

    def quantize(self, units: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale -> their stored bytes (uint8)."""
        units = units.clamp(-self.qmax, self.qmax)
        if self.kind == "int8":
            return units.round_().to(torch.int8).view(torch.uint8)
        # fp8 through float16, as in _units_unscaled (torch's float8 cast is one element at a
        # time on CPU): round float16's 10 mantissa bits to e4m3's 3, to nearest even
        bits = units.mul_(2.0**-8).to(torch.float16).view(torch.int16)
        rounded = bits + (0x3F + (bits >> 7 & 1))
        return ((rounded >> 7 & 0x7F) | (bits >> 8 & 0x80)).to(torch.uint8)

    def to_units(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored bytes (uint8) -> their values in units of their scale, as `dtype`.
        fp8: torch converts float8 one element at a time on CPU, so the bits are moved into a
        float16 instead (vectorized, and exact: e4m3's 4 exponent and 3 mantissa bits fit
        float16's 5 and 10), which reads as the value times 2**-8 (exponent biases 7 and 15)."""
        return self._units_unscaled(stored, dtype).mul_(1.0 if self.kind == "int8" else 256.0)

    def _units_unscaled(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """to_units, but fp8 values come out times 2**-8 (`_FP8_HALF_SCALE` undoes it)."""
        if self.kind == "int8":
            return stored.view(torch.int8).to(dtype)
        signed = stored.view(torch.int8).to(torch.int16)  # the sign bit fills bits 7-15
        # s mmmmmmm -> s 0 mmmmmmm 0000000: the sign to float16's, the rest to the low
        # exponent bits and the top of the mantissa (bit 14, a copy of the sign, cleared)
        half = signed.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)
        return half.to(dtype)

    def dequantize(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks [..., block_bytes] uint8 -> [..., block_size, head_dim] in `dtype`."""
        values, scales = self.split(blocks)
        # a contiguous copy of the scales: broadcasting the strided view is 4x slower on CPU
        scales = scales.to(dtype, copy=True) * (1.0 if self.kind == "int8" else 256.0)
        return self._units_unscaled(values, dtype).mul_(scales[..., None, None])

    def gather_pair(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `ids` of one layer's keys and values, dequantized to `dtype`: each
        [heads, len(ids), block_size, head_dim]; one gather and one dequantization for both
        when the two caches are the halves of one layer's [2, heads, blocks, block_bytes]."""
        both = _both_halves(key_cache, value_cache)
        if both is None:
            keys = self.dequantize(key_cache.index_select(1, ids), dtype)
            return keys, self.dequantize(value_cache.index_select(1, ids), dtype)
        kv = self.dequantize(both.index_select(1, ids), dtype)
        return kv[: key_cache.shape[0]], kv[key_cache.shape[0] :]

    def write_pair(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """`write` for one layer's keys and values; in one pass when the two caches are the
        halves of one layer's [2, heads, blocks, block_bytes] (KVCache.key / value)."""
        both = _both_halves(key_cache, value_cache)
        if both is not None:
            self.write(torch.cat((k, v), dim=1), both, slot_mapping)
        else:
            self.write(k, key_cache, slot_mapping)
            self.write(v, value_cache, slot_mapping)

    def write(self, x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize rows x [num_tokens, num_kv_heads, head_dim] into their flat slots of one
        layer's keys or values, cache [num_kv_heads, num_blocks, block_bytes] (in place).

        No two rows of one step write one slot, and the blocks a step writes belong to the
        step's own sequences (a shared prefix block is full, never written). Only the scales
        of the touched blocks are read; the earlier entries of a block are requantized only
        where its scale grew, which a decode step's one new row per block seldom makes it do."""
        blocks = torch.div(slot_mapping, self.block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * self.block_size
        touched, inverse = torch.unique(blocks, return_inverse=True)  # [U], [T]
        values, scales = self.split(cache)  # views: [heads, blocks, bs, hd], [heads, blocks]
        old = scales.index_select(1, touched)  # [heads, U]
        old.index_fill_(1, inverse[offsets == 0], 0.0)  # blocks this write begins: stale scale
        row_max = x.abs().amax(-1).t().float()  # [heads, T]
        new_max = torch.zeros_like(old).scatter_reduce_(
            1, inverse.expand_as(row_max), row_max, "amax"
        )
        need = new_max / self.qmax
        grow = need > old
        if self.kind in _HEADROOM:  # blocks this write leaves partly filled get room to grow
            last = torch.zeros_like(touched).scatter_reduce_(0, inverse, offsets, "amax")
            need *= torch.where(last == self.block_size - 1, 1.0, _HEADROOM[self.kind])
        scale = torch.where(grow, need, old).clamp_(min=_TINY)
        grown = ((scale > old) & (old > 0)).any(0).nonzero().squeeze(1)  # into touched
        if grown.numel():
            self._requantize(cache, touched[grown], (old / scale)[:, grown])
        new_rows = x.transpose(0, 1).float() / scale[:, inverse, None]  # [heads, T, head_dim]
        values[:, blocks, offsets] = self.quantize(new_rows)
        scales[:, touched] = scale

    def _requantize(self, cache: torch.Tensor, ids: torch.Tensor, ratio: torch.Tensor) -> None:
        """The values of blocks `ids`, in units of a grown scale (old / new = `ratio`)."""
        num_values = self.block_size * self.head_dim
        gathered = cache.index_select(1, ids)  # whole blocks: a plain copy per block and head
        units = self.to_units(gathered[..., :num_values], torch.float32).mul_(ratio[..., None])
        gathered[..., :num_values] = self.quantize(units)
        cache.index_copy_(1, ids, gathered)  # their scales, unchanged here, with them

    def dequantize_tables(
        self, cache: torch.Tensor, tables: list[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """For kernels that read a paged cache at the compute dtype (flash-attn): the blocks the
        block `tables` name, dequantized into a compact cache [heads, U, block_size, head_dim],
        and the tables renumbered to index it."""
        ids = torch.cat([table.reshape(-1) for table in tables]).unique()
        dense = self.dequantize(cache.index_select(1, ids), dtype)
        lookup = torch.zeros(cache.shape[1], dtype=torch.long, device=cache.device)
        lookup[ids] = torch.arange(ids.numel(), device=cache.device)
        return dense, [lookup[table.long()].to(table.dtype) for table in tables]


def _both_halves(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor | None:
    """[2 * heads, blocks, block_bytes] over both caches, when they are the halves of one
    layer's [2, heads, blocks, block_bytes] (KVCache.key / value); else None."""
    num_heads = key_cache.shape[0]
    if value_cache.data_ptr() - key_cache.data_ptr() != key_cache.stride(0) * num_heads:
        return None
    if key_cache.stride(0) != key_cache.shape[1] * key_cache.stride(1):
        return None
    return key_cache.as_strided((2 * num_heads, *key_cache.shape[1:]), key_cache.stride())


def quant_format(kv_cache_dtype: str, block_size: int, head_dim: int) -> KVQuantFormat | None:
    """The format of a `kv_cache_dtype` cache, or None for "auto" (unquantized)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return None
    return KVQuantFormat(kv_cache_dtype, block_size, head_dim)
