"""Gemma 3 (text only, `Gemma3ForCausalLM`), TP-sharded, on the Llama building blocks.

What differs from Llama, each as transformers computes it:
- RMSNorm multiplies by (1 + weight), in float32, and casts after the multiply;
- four norms per layer: the attention and MLP outputs are normed before their residual adds;
- per-head q/k norms before RoPE, scores scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers (from `layer_types`, five of six in the published models) with a RoPE
  base of their own (`ModelConfig.local_rope_parameters`); full layers use `rope_parameters`;
- embeddings multiplied by sqrt(hidden_size); tied output embeddings; the MLP's activation is
  tanh-approximated GELU; final logits optionally soft-capped (`LlamaForCausalLM.compute_logits`).
Attention-score soft-capping (Gemma 2) is refused by engine.model_config: Gemma 3 has none.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.rope import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    norm_class = GemmaRMSNorm


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__(config, layer_idx, backend)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(config, backend, max_positions)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        param = self.embed_tokens.weight
        local_rope = config.local_rope_parameters or config.rope_parameters
        self.local_rotary = RotaryEmbedding(
            config.head_dim, max_positions, local_rope, param.dtype, param.device
        )
        self.sliding = [window is not None for window in config.sliding_windows]
        # as transformers keeps it: a scalar in the model dtype
        self.embed_scale = torch.tensor(config.embed_scale or 1.0, dtype=param.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        full = self.rotary.cos_sin(positions)
        local = self.local_rotary.cos_sin(positions) if any(self.sliding) else full
        hidden = self.embed_tokens(input_ids) * self.embed_scale.to(input_ids.device)
        for layer, sliding in zip(
            self.layers, self.sliding or [False] * len(self.layers), strict=True
        ):
            cos, sin = local if sliding else full
            hidden = layer(hidden, cos, sin, metadata)
        return self.norm(hidden)
