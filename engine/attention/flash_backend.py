"""flash-attn back end (CUDA only; imported only when flash_attn is installed).

Uses flash-attn 2's paged kernels: `flash_attn_with_kvcache` for decode and
`flash_attn_varlen_func` with a block table for prefill chunks (causal is bottom-right aligned,
which is exactly "attend to the cached prefix plus causally within the chunk"). Both need the KV
page size to be a multiple of 256, which `select_backend` checks. They take the head-major cache
through `paged_view`, a strided [blocks, block_size, heads, head_dim] view (flash-attn reads the
cache through its strides and needs only the last dim contiguous). Untested on CPU machines.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from engine.attention.backend import AttentionBackend, write_kv
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import paged_view


class FlashAttentionBackend(AttentionBackend):
    name = "flash"
    # an 8-bit cache: the blocks a step reads are dequantized into a compact cache first
    reads_quantized_kv = True

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
        decode_tables, prefill_tables = metadata.decode_block_tables, metadata.prefill_block_tables
        quant = self.kv_quant
        if quant is None:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        else:
            quant.write_pair(k, v, key_cache, value_cache, metadata.slot_mapping)
            tables = [decode_tables, prefill_tables]
            key_cache, _ = quant.dequantize_tables(key_cache, tables, q.dtype)
            value_cache, (decode_tables, prefill_tables) = quant.dequantize_tables(
                value_cache, tables, q.dtype
            )
        key_cache, value_cache = paged_view(key_cache), paged_view(value_cache)
        # flash-attn's window (left, right): a query sees keys q_pos - left .. q_pos + right
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        out = torch.empty_like(q)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = flash_attn_with_kvcache(
                q[:num_decodes].unsqueeze(1),
                key_cache,
                value_cache,
                cache_seqlens=metadata.decode_context_lens.to(torch.int32),
                block_table=decode_tables.to(torch.int32),
                softmax_scale=scale,
                causal=True,
                window_size=window,
            ).squeeze(1)
        if metadata.prefills:
            out[num_decodes:] = flash_attn_varlen_func(
                q[num_decodes:],
                key_cache,
                value_cache,
                cu_seqlens_q=metadata.prefill_query_start_loc,
                cu_seqlens_k=metadata.prefill_context_start_loc,
                max_seqlen_q=metadata.max_prefill_query_len,
                max_seqlen_k=metadata.max_prefill_context_len,
                softmax_scale=scale,
                causal=True,
                window_size=window,
                block_table=prefill_tables,
            )
        return out
