"""Attention with plain torch ops (CPU and CUDA): the reference back end and the CPU fast path.

Decode: one gather of all decode sequences' blocks, then one batched SDPA with a length mask.
GQA without copying KV per query head: the g = num_heads // num_kv_heads query heads that share a
KV head are laid out as SDPA's query-length dim, so K/V are read once per KV head.
Prefill: one SDPA per chunk (causal; with a mask when the chunk follows cached positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, write_kv
from engine.attention.metadata import AttentionMetadata, PrefillChunkInfo


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
        write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = _decode(
                q[:num_decodes], key_cache, value_cache, metadata, scale, sliding_window
            )
        for chunk in metadata.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = _prefill_chunk(
                q[rows], k[rows], v[rows], key_cache, value_cache, chunk, metadata, scale,
                sliding_window,
            )
        return out


def _decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float, sliding_window: int | None,
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    keys = _gather_blocks(key_cache, metadata.decode_block_tables).transpose(0, 1)
    values = _gather_blocks(value_cache, metadata.decode_block_tables).transpose(0, 1)
    mask = _decode_mask(metadata, sliding_window)  # [num_decodes, 1, 1, L]
    queries = q.view(num_decodes, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[rows, max_blocks] block ids -> [kv_heads, rows, max_blocks * block_size, head_dim].

    index_select over whole blocks (one contiguous block_size x head_dim piece per head) is a
    plain memcpy per block and head, several times faster on CPU than advanced indexing with a
    2-D index; per head the result is already SDPA's [seq, head_dim].
    """
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows, max_blocks = block_tables.shape
    flat = cache.view(num_kv_heads, num_blocks, -1).index_select(1, block_tables.reshape(-1))
    return flat.view(num_kv_heads, rows, max_blocks * block_size, head_dim)


def _decode_mask(metadata: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
    key = ("decode", sliding_window)
    mask = metadata.mask_cache.get(key)
    if mask is None:
        context_lens = metadata.decode_context_lens[:, None]  # [num_decodes, 1]
        key_pos = torch.arange(metadata.max_decode_context_len, device=context_lens.device)
        mask = key_pos[None, :] < context_lens
        if sliding_window is not None:
            mask &= key_pos[None, :] > context_lens - 1 - sliding_window
        mask = mask[:, None, None, :]
        metadata.mask_cache[key] = mask
    return mask


def _prefill_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, chunk: PrefillChunkInfo, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    # SDPA wants 4-D [1, heads, len, head_dim]: with 3-D inputs CPU falls back to the slow math path
    queries = q.transpose(0, 1).unsqueeze(0)
    if chunk.start_pos == 0:  # the chunk is the whole context
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    else:  # [1, kv_heads, context_len, head_dim] straight from the head-major gather
        table = chunk.block_table[None, :]
        keys = _gather_blocks(key_cache, table)[:, :, : chunk.context_len].transpose(0, 1)
        values = _gather_blocks(value_cache, table)[:, :, : chunk.context_len].transpose(0, 1)
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
    """[n, context_len] bool: query i (position start_pos + i) may see key position j."""
    key = ("prefill", chunk.token_start, sliding_window)
    mask = metadata.mask_cache.get(key)
    if mask is None:
        device = chunk.block_table.device
        query_pos = torch.arange(chunk.start_pos, chunk.context_len, device=device)[:, None]
        key_pos = torch.arange(chunk.context_len, device=device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        metadata.mask_cache[key] = mask
    return mask
