"""The Llama decoder's forward with the fused Triton ops of engine/kernels/fused_ops.py.

The same modules and weights as LlamaForCausalLM.forward, in fewer launches per layer: the
residual stream is carried beside the hidden states, so each RMSNorm takes the add before it
in one kernel (vLLM's layout), rotary turns q and k inside the fused qkv output in place, and
SiLU x mul is one kernel. Per layer this replaces about 15 launches (two norms at 4 each, rotary
at 6, the residual adds, SiLU and mul) with 4.

    layer i:  normed, residual = add_rms_norm(hidden, residual)   # residual += hidden
              hidden = attention(normed)
              normed, residual = add_rms_norm(hidden, residual)
              hidden = mlp(normed)
    final:    add_rms_norm(hidden, residual)

Models whose layers are LlamaDecoderLayer with plain RMSNorm take it (Llama, Mistral, Qwen2,
Qwen3 and their MoE layers, Phi-3); Gemma 3's extra norms keep the torch forward. A layer with a
q/k norm (Qwen3) or a GELU MLP keeps the torch op for that part.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.kernels.fused_ops import add_rms_norm, rotary_, silu_and_mul
from engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
)


def supports(model: torch.nn.Module) -> bool:
    if not isinstance(model, LlamaForCausalLM) or type(model.norm) is not RMSNorm:
        return False
    return all(
        type(layer) is LlamaDecoderLayer
        and type(layer.input_layernorm) is RMSNorm
        and type(layer.post_attention_layernorm) is RMSNorm
        for layer in model.layers
    )


def forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Final hidden states [num_tokens, hidden_size], as LlamaForCausalLM.forward."""
    hidden = model.embed_tokens(input_ids)
    residual: torch.Tensor | None = None
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        hidden, residual = _norm(layer.input_layernorm, hidden, residual)
        attention = layer.self_attn
        if attention.q_norm is not None:  # Qwen3: per-head q/k norms, the torch path
            if cos_sin is None:
                cos_sin = model.rotary.cos_sin(positions)
            hidden = attention(hidden, *cos_sin, metadata)
        else:
            hidden = _attention(attention, hidden, positions, model, metadata)
        hidden, residual = _norm(layer.post_attention_layernorm, hidden, residual)
        mlp = layer.mlp
        if isinstance(mlp, LlamaMLP) and not mlp.gelu:
            hidden = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(hidden)))
        else:
            hidden = mlp(hidden)
    return _norm(model.norm, hidden, residual)[0]


def _norm(
    norm: torch.nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(norm, RMSNorm)
    return add_rms_norm(hidden, residual, norm.weight, norm.eps)


def _attention(
    attention: LlamaAttention,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    model: LlamaForCausalLM,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    assert attention.key_cache is not None and attention.value_cache is not None
    num_tokens = hidden.shape[0]
    heads, kv_heads = attention.num_local_heads, attention.num_local_kv_heads
    head_dim = attention.head_dim
    qkv = attention.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
    rotary_(qkv, positions, model.rotary.cos, model.rotary.sin, heads + kv_heads, head_dim)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    out = attention.backend.forward(
        q,
        k,
        v,
        attention.key_cache,
        attention.value_cache,
        metadata,
        attention.scale,
        attention.sliding_window,
    )
    return attention.o_proj(out.reshape(num_tokens, heads * head_dim))
