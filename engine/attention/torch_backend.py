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
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_tables = metadata.decode_block_tables  # [num_decodes, max_blocks]
    # [num_decodes, max_blocks, block_size, kv_heads, head_dim] -> [num_decodes, kv_heads, L, head_dim]
    keys = key_cache[block_tables].flatten(1, 2).transpose(1, 2)
    values = value_cache[block_tables].flatten(1, 2).transpose(1, 2)
    mask = _decode_mask(metadata, sliding_window)  # [num_decodes, 1, 1, L]
    queries = q.view(num_decodes, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


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
    queries = q.transpose(0, 1)  # [num_heads, n, head_dim]
    if chunk.start_pos == 0:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # the chunk is the whole context
    else:
        num_kv_heads, head_dim = key_cache.shape[2:]
        keys = key_cache[chunk.block_table].view(-1, num_kv_heads, head_dim)[: chunk.context_len]
        values = value_cache[chunk.block_table].view(-1, num_kv_heads, head_dim)[: chunk.context_len]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    if chunk.start_pos == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        mask = _prefill_mask(chunk, metadata, sliding_window)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)


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
