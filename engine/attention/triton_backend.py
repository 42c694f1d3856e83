"""Attention with the Triton kernels of engine/kernels/paged_attention.py (CUDA, or CPU under
Triton's interpreter in tests).

The KV write and decode attention read and write the head-major cache in place: no gather of a
sequence's blocks and no padding to the longest sequence. Prefill chunks (eager steps only) go
through the torch back end's SDPA per chunk. Fixed-shape steps (engine/graphs.py) pass padding
rows as slot -1 and context length 0; both kernels skip them, so this back end runs under a CUDA
graph with `metadata.num_padding` ignored.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, _prefill_chunk
from engine.kernels.paged_attention import paged_decode_attention, write_kv


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"
    handles_padding = True
    # The kernels read the model dtype's cache only: an 8-bit KV cache takes the torch back end
    # (the model runner swaps it in), whatever the torch back end it subclasses reads.
    reads_quantized_kv = False

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
            paged_decode_attention(
                q[:num_decodes],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                scale,
                sliding_window,
                out=out[:num_decodes],
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
            )
        return out
