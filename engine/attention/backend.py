"""The attention back-end interface.

A back end computes attention for one layer of one step over the paged KV cache:

- It first writes the step's new K/V into the cache at `metadata.slot_mapping` (flat slots,
  `block_id * block_size + offset`), in place: the cache is never reallocated or concatenated.
- Decode tokens (the first `metadata.num_decode_tokens` rows) attend to every cached position of
  their sequence, including the one just written.
- Prefill-chunk tokens attend causally within their chunk and to all `start_pos` positions already
  cached for their sequence.
- A layer with a sliding window W only attends to key positions k with q_pos - k < W (as
  transformers' Mistral/Qwen2 do).

With `kv_quant` set (an 8-bit cache), a back end writes through `KVQuantFormat.write` and reads
dequantized blocks (engine/kv_quant.py).

Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
key_cache, value_cache [num_kv_heads, num_blocks, block_size, head_dim] (head-major, see
engine/kv_cache.py); returns
[num_tokens, num_heads, head_dim]. Query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_quant import KVQuantFormat


class AttentionBackend(ABC):
    name: str = "abstract"
    # Whether this back end reads a quantized cache: set `kv_quant` and the caches are uint8
    # [num_kv_heads, num_blocks, block_bytes], written with kv_quant.write (engine/kv_quant.py).
    reads_quantized_kv: bool = False
    kv_quant: KVQuantFormat | None = None
    # Whether forward skips padding rows (slot -1, context length 0) by itself, without reading
    # `metadata.num_padding` on the host: what a CUDA graph of a fixed-shape step needs.
    handles_padding: bool = False

    @abstractmethod
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
        """Write k/v into the caches, then return the attention output (see the module doc)."""

    def step_context(self) -> contextlib.AbstractContextManager[object]:
        """Entered once around a whole step's forward (every layer): kernel settings go here."""
        return contextlib.nullcontext()


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into their flat slots (index_copy_, in place)."""
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[-1]
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))
