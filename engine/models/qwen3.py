"""Qwen3: the Llama block with a per-head RMSNorm on q and k before RoPE (`ModelConfig.qk_norm`).

The norms' checkpoint names (`self_attn.q_norm`, `self_attn.k_norm`) are those of our layers, and
their weights ([head_dim]) are replicated on every TP rank, since they act within one head.
Qwen3's optional sliding windows come from the config's `layer_types`, as for Qwen2.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
