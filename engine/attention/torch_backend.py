"""Attention with plain torch ops (CPU and CUDA): the reference back end and the CPU fast path.

Decode: the decode sequences in groups of similar length; per group one gather of its blocks and
one batched SDPA with a length mask. One batch pads every sequence to the longest: at contexts of
50-900 tokens (8 sequences, 2,700 in all) a step took 28.2 ms against 21.8 at 337 each. The
groups are the split of the sequences sorted by length that costs least, each group counted as
its padded tokens plus GROUP_COST_TOKENS for its own gather and SDPA call. On CUDA
(`cuda=True`, engine.attention.select_backend) one padded batch: a step there is host
time, and each group adds launches per layer and new SDPA shapes (torch ops per step on a tiny
model: 753 against 688 at equal lengths, 1,523 against 658 mixed); on an H200, 31M model, mixed
lengths, the engine ran 450 tokens/s with groups and 570 without (both with cuDNN's SDPA, which
the step now keeps off: see _CUDA_SDPA).
GQA without copying KV per query head: the g = num_heads // num_kv_heads query heads that share a
KV head are laid out as SDPA's query-length dim, so K/V are read once per KV head.
Prefill: one SDPA per chunk (causal; with a mask when the chunk follows cached positions).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.backend import AttentionBackend, write_kv
from engine.attention.metadata import AttentionMetadata, PrefillChunkInfo
from engine.kv_quant import KVQuantFormat


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    reads_quantized_kv = True  # an 8-bit cache: each gather of blocks is dequantized

    def __init__(self, cuda: bool = False) -> None:
        # Groups pay off where attention FLOPs cost (CPU); on CUDA each group's extra launches
        # per layer cost more host time than the padding they save (see the module doc).
        self.cuda = cuda
        self.group_decodes = not cuda

    def step_context(self) -> contextlib.AbstractContextManager[object]:
        return sdpa_kernel(_CUDA_SDPA) if self.cuda else contextlib.nullcontext()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if metadata.num_padding:  # a fixed-shape step run eagerly: attend over the real rows
            real = q.shape[0] - metadata.num_padding
            unpadded = metadata.mask_cache.get("unpadded")
            if unpadded is None:
                unpadded = metadata.mask_cache["unpadded"] = metadata.without_padding()
            out = torch.zeros_like(q)
            out[:real] = self.forward(
                q[:real],
                k[:real],
                v[:real],
                key_cache,
                value_cache,
                unpadded,
                scale,
                sliding_window,
            )
            return out
        quant = self.kv_quant
        if quant is None:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        else:
            quant.write_pair(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = _decode(
                q[:num_decodes],
                key_cache,
                value_cache,
                metadata,
                scale,
                sliding_window,
                self.group_decodes,
                quant,
            )
        for chunk in metadata.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = _prefill_chunk(
                q[rows],
                k[rows],
                v[rows],
                key_cache,
                value_cache,
                chunk,
                metadata,
                scale,
                sliding_window,
                quant,
            )
        return out


# SDPA kernels on CUDA: every one but cuDNN's. torch picks cuDNN first on Hopper, and it builds
# an execution plan per new shape; a serving engine's shapes change every step (batch, context,
# chunk), so on an H200 the engine ran 570 tokens/s with it against 3,144 without (31M model,
# bf16, mixed lengths; 1.1B: 439 against 1,719), benchmarks/results/engine-h200.json.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    grouped: bool = True,
    quant: KVQuantFormat | None = None,
) -> torch.Tensor:
    if sliding_window is not None:
        tables, mask = _window_tables_and_mask(metadata, sliding_window)
        return _attend(q, key_cache, value_cache, tables, mask, scale, quant)
    if not grouped:
        mask = _decode_mask(metadata, sliding_window)
        tables = metadata.decode_block_tables
        return _attend(q, key_cache, value_cache, tables, mask, scale, quant)
    groups = _decode_groups(metadata, sliding_window)
    if len(groups) == 1:
        _, tables, mask = groups[0]
        return _attend(q, key_cache, value_cache, tables, mask, scale, quant)
    out = torch.empty_like(q)
    for rows, tables, mask in groups:
        out[rows] = _attend(q[rows], key_cache, value_cache, tables, mask, scale, quant)
    return out


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    quant: KVQuantFormat | None = None,
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    if quant is None:
        keys = _gather_blocks(key_cache, tables).transpose(0, 1)
        values = _gather_blocks(value_cache, tables).transpose(0, 1)
    else:  # keys and values in one gather and one dequantization
        rows, max_blocks = tables.shape
        pair = quant.gather_pair(key_cache, value_cache, tables.reshape(-1), q.dtype)
        shape = (num_kv_heads, rows, max_blocks * quant.block_size, head_dim)
        keys, values = (half.reshape(shape).transpose(0, 1) for half in pair)
    queries = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


# A group's own gather and SDPA call, in padded tokens of attention. On CPU (Llama, 8 heads of 64,
# 2 KV heads; batches of 4-16 at contexts of 25-950) 32-512 were tried: 128-256 did best (the
# 8-sequence batch above: 21.0 ms, against 30.6 in one group and 21.5 at 8 x 337 tokens).
GROUP_COST_TOKENS = 128


def split_by_length(lengths: list[int], group_cost: int) -> list[int]:
    """Where to cut `lengths` (ascending) into groups, as the end index of each group: the
    split with the least Σ (group size * its longest + group_cost), by dynamic programming."""
    count = len(lengths)
    best = [0] * (count + 1)  # best[j]: the least cost of lengths[:j]
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        choices = (
            (best[start] + (end - start) * lengths[end - 1] + group_cost, start)
            for start in range(end)
        )
        best[end], cut[end] = min(choices)
    ends, end = [], count
    while end:
        ends.append(end)
        end = cut[end]
    return ends[::-1]


def _decode_groups(
    metadata: AttentionMetadata, sliding_window: int | None
) -> list[tuple[torch.Tensor | slice, torch.Tensor, torch.Tensor]]:
    """(rows, block tables, mask) per group of similar length, built once per step."""
    key = ("decode_groups", sliding_window)
    groups = metadata.mask_cache.get(key)
    if groups is not None:
        return groups
    block_size = metadata.block_size
    lens = metadata.decode_context_lens
    blocks = [-(-n // block_size) for n in lens.tolist()]  # CPU only: no device sync
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    ends = split_by_length([blocks[i] for i in order], -(-GROUP_COST_TOKENS // block_size))
    if len(ends) == 1:
        whole = (slice(None), metadata.decode_block_tables, _decode_mask(metadata, sliding_window))
        groups = [whole]
    else:
        groups, start = [], 0
        for end in ends:
            rows = torch.tensor(order[start:end], dtype=torch.long, device=lens.device)
            width = blocks[order[end - 1]]
            tables = metadata.decode_block_tables[rows, :width]
            groups.append(
                (rows, tables, _length_mask(lens[rows], width * block_size, sliding_window))
            )
            start = end
    metadata.mask_cache[key] = groups
    return groups


def _gather_blocks(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    quant: KVQuantFormat | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[rows, max_blocks] block ids -> [kv_heads, rows, max_blocks * block_size, head_dim].

    index_select over whole blocks (one contiguous block_size x head_dim piece per head) is a
    plain memcpy per block and head, several times faster on CPU than advanced indexing with a
    2-D index; per head the result is already SDPA's [seq, head_dim]. A quantized cache's
    blocks (their scales with them) are gathered the same way, then dequantized to `dtype`.
    """
    rows, max_blocks = block_tables.shape
    if quant is not None:
        assert dtype is not None, "a quantized cache dequantizes to the query's dtype"
        blocks = cache.index_select(1, block_tables.reshape(-1))  # [heads, n, block_bytes]
        kv = quant.dequantize(blocks, dtype)  # [heads, n, block_size, head_dim]
        return kv.view(cache.shape[0], rows, max_blocks * quant.block_size, quant.head_dim)
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.view(num_kv_heads, num_blocks, -1).index_select(1, block_tables.reshape(-1))
    return flat.view(num_kv_heads, rows, max_blocks * block_size, head_dim)


def _decode_mask(metadata: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
    key = ("decode", sliding_window)
    mask = metadata.mask_cache.get(key)
    if mask is None:
        mask = _length_mask(
            metadata.decode_context_lens, metadata.max_decode_context_len, sliding_window
        )
        metadata.mask_cache[key] = mask
    return mask


def _window_tables_and_mask(
    metadata: AttentionMetadata, sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode block tables cut to the blocks that hold a key inside the window, and their mask.

    Row i (context L) sees key positions L - W .. L - 1: blocks (L - W) // block_size onwards;
    the blocks before are never read. At most (W - 1) // block_size + 2 blocks hold the window,
    so every row's cut table has that width (known without reading L back from the device)."""
    key = ("decode_window", sliding_window)
    cached = metadata.mask_cache.get(key)
    if cached is not None:
        return cached
    block_size = metadata.block_size
    tables, lens = metadata.decode_block_tables, metadata.decode_context_lens
    width = min(tables.shape[1], (sliding_window - 1) // block_size + 2)
    first = (lens - sliding_window).clamp_(min=0) // block_size  # [rows] first block read
    columns = first[:, None] + torch.arange(width, device=lens.device)[None, :]
    cut = tables.gather(1, columns.clamp_(max=tables.shape[1] - 1))
    key_pos = first[:, None] * block_size + torch.arange(width * block_size, device=lens.device)
    context_lens = lens[:, None]
    mask = (key_pos < context_lens) & (key_pos > context_lens - 1 - sliding_window)
    metadata.mask_cache[key] = (cut, mask[:, None, None, :])
    return metadata.mask_cache[key]


def _length_mask(lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """[rows, 1, 1, width] bool: row i sees key positions below lens[i] (in its window)."""
    context_lens = lens[:, None]
    key_pos = torch.arange(width, device=lens.device)
    mask = key_pos[None, :] < context_lens
    if sliding_window is not None:
        mask &= key_pos[None, :] > context_lens - 1 - sliding_window
    return mask[:, None, None, :]


def _prefill_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunk: PrefillChunkInfo,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    quant: KVQuantFormat | None = None,
) -> torch.Tensor:
    # SDPA wants 4-D [1, heads, len, head_dim]: with 3-D inputs CPU falls back to the slow math path
    queries = q.transpose(0, 1).unsqueeze(0)
    # The chunk is the whole context: its own k/v, unless the cache is 8-bit, where attention
    # reads what the cache holds, as every later chunk and decode step does (so a prefix hit or
    # another chunking attends to the same values as a miss, and the hand-off ships them).
    if chunk.start_pos == 0 and quant is None:
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    else:  # [1, kv_heads, context_len, head_dim] straight from the head-major gather
        # a sliding layer skips the blocks wholly before its first query's window
        first = _first_window_block(chunk, metadata.block_size, sliding_window)
        table = chunk.block_table[None, first:]
        length = chunk.context_len - first * metadata.block_size
        keys = _gather_blocks(key_cache, table, quant, q.dtype)[:, :, :length].transpose(0, 1)
        values = _gather_blocks(value_cache, table, quant, q.dtype)[:, :, :length].transpose(0, 1)
    if chunk.start_pos == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        mask = _prefill_mask(chunk, metadata, sliding_window)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)


def _prefill_mask(
    chunk: PrefillChunkInfo, metadata: AttentionMetadata, sliding_window: int | None
) -> torch.Tensor:
    """[n, keys] bool: query i (position start_pos + i) may see key j (position j, or j plus
    the first position read by a sliding layer, see _first_window_block)."""
    key = ("prefill", chunk.token_start, sliding_window)
    mask = metadata.mask_cache.get(key)
    if mask is None:
        device = chunk.block_table.device
        query_pos = torch.arange(chunk.start_pos, chunk.context_len, device=device)[:, None]
        key_start = _first_window_block(chunk, metadata.block_size, sliding_window)
        key_start *= metadata.block_size
        key_pos = torch.arange(key_start, chunk.context_len, device=device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        metadata.mask_cache[key] = mask
    return mask


def _first_window_block(
    chunk: PrefillChunkInfo, block_size: int, sliding_window: int | None
) -> int:
    """The first block a chunk's attention reads: 0, or for a sliding layer of a chunk after
    cached positions the block of its first query's earliest key (start_pos - W + 1)."""
    if sliding_window is None or chunk.start_pos == 0:
        return 0
    return max(0, chunk.start_pos - sliding_window + 1) // block_size
