"""Qwen2: the Llama block with q/k/v biases (no o_proj bias) and, in small models, tied embeddings.

Both differences are read from the config (`ModelConfig.qkv_bias`, `tie_word_embeddings`), as are
Qwen2's optional per-layer sliding windows (`ModelConfig.sliding_windows`).
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
