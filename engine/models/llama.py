"""The Llama decoder (Llama-2, Llama-3, and via config flags Mistral, Qwen2, Qwen3, Phi-3 and
Qwen3-MoE's sparse MLP layers), TP-sharded; Gemma 3 swaps in its own layer and norm classes.

Forward runs over the step's packed tokens with no padding: input_ids and positions are
[num_tokens]; hidden states are [num_tokens, hidden_size]. q/k/v are one fused column-parallel
matmul and gate/up another (fused at load time). Layers see only tensors and the step's
AttentionMetadata, never requests.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.models.moe import SparseMoeBlock
from engine.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight


class LlamaAttention(nn.Module):
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.qkv_bias,
        )
        self.num_local_heads = self.qkv_proj.num_local_heads
        self.num_local_kv_heads = len(self.qkv_proj.kv_head_ids)
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.scale = config.attention_scale or config.head_dim**-0.5
        # Qwen3 / Gemma 3: RMSNorm over each head's q and k before RoPE.
        self.q_norm = (
            self.norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        )
        self.k_norm = (
            self.norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        )
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.backend = backend
        # Views into the step-invariant KV cache, set by bind_kv_cache:
        # [num_blocks, block_size, num_local_kv_heads, head_dim] each.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.key_cache is not None and self.value_cache is not None, "KV cache not bound"
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        num_qk_heads = self.num_local_heads + self.num_local_kv_heads
        # q and k are adjacent in the fused output: rotate both with one call.
        qk = qkv[:, : num_qk_heads * self.head_dim].view(num_tokens, num_qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            heads = self.num_local_heads
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, : self.num_local_heads]
        k = qk[:, self.num_local_heads :]
        v = qkv[:, num_qk_heads * self.head_dim :].view(
            num_tokens, self.num_local_kv_heads, self.head_dim
        )
        out = self.backend.forward(
            q, k, v, self.key_cache, self.value_cache, metadata, self.scale, self.sliding_window
        )
        return self.o_proj(out.view(num_tokens, self.num_local_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(activated.mul_(up))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx, backend)
        sparse = bool(config.moe_layers) and config.moe_layers[layer_idx]
        self.mlp: nn.Module = SparseMoeBlock(config) if sparse else LlamaMLP(config)
        self.input_layernorm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# checkpoint projection name -> (our fused parameter, shard id inside it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


class LlamaForCausalLM(nn.Module):
    """Built in the dtype/device of the caller's defaults (see engine.loader.build_model)."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # Set by the model runner on CUDA where engine/models/fused_llama.py supports the model.
    fused_ops: bool = False

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, backend) for i in range(config.num_layers)
        )
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        param = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_parameters, param.dtype, param.device
        )

    def _attention_layers(self) -> list[LlamaAttention]:
        """Each layer's attention, typed (iterating an nn.ModuleList yields plain Modules)."""
        attention = []
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer), "self.layers holds decoder layers only"
            attention.append(layer.self_attn)
        return attention

    @property
    def num_local_kv_heads(self) -> int:
        return self._attention_layers()[0].num_local_kv_heads

    def bind_kv_cache(self, kv_cache: KVCache) -> None:
        for layer_idx, attention in enumerate(self._attention_layers()):
            attention.key_cache = kv_cache.key(layer_idx)
            attention.value_cache = kv_cache.value(layer_idx)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] (after the last norm)."""
        if self.fused_ops:  # engine/models/fused_llama.py: the same math in fewer launches
            from engine.models import fused_llama

            return fused_llama.forward(self, input_ids, positions, metadata)
        cos, sin = self.rotary.cos_sin(positions)  # once per step, shared by all layers
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [num_rows, vocab_size] on every TP rank."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_param(self, checkpoint_name: str) -> tuple[str, int] | None:
        """Our parameter name and shard id for a checkpoint tensor, or None to skip it."""
        if "rotary_emb.inv_freq" in checkpoint_name:
            return None
        if checkpoint_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        name = checkpoint_name.removeprefix("model.")
        match = _FUSED_NAME.search(name)
        if match is None:
            return name, 0
        fused, shard_id = _FUSED[match.group(1)]
        return name.replace(f".{match.group(1)}.", f".{fused}."), shard_id

    def checkpoint_targets(self, checkpoint_name: str) -> list[tuple[str, int, int]]:
        """(our parameter, shard id, first row of the shard's part in the checkpoint tensor) for
        each part of a checkpoint tensor: one part, unless the checkpoint fuses several."""
        target = self.checkpoint_param(checkpoint_name)
        return [] if target is None else [(target[0], target[1], 0)]
