"""Tiny random-weight Hugging Face models, saved with `save_pretrained`, for tests on CPU.

    make_tiny_model(tmp_path, family="llama", sharded=False, **config_overrides) -> model_dir

Families (all small: hidden 64, 2 layers, vocab 512):
    "llama"    Llama-2 style, GQA (4 query heads, 2 KV heads), default RoPE
    "llama3"   Llama-3 style, GQA, rope_type "llama3" with a short original context so the
               frequency scaling actually changes some frequencies
    "qwen2"    q/k/v bias, tied input/output embeddings
    "mistral"  one KV head, explicit head_dim, sliding window of 32 tokens
    "qwen3"    per-head q/k RMSNorm, explicit head_dim
    "phi3"     q/k/v and gate/up fused in the checkpoint
    "qwen3_moe" 3 layers: 8 experts, top-2 with renormalised weights; layer 1 dense
    "mixtral"  4 experts of width 64, top 2, on both layers; sliding window of 24 tokens
    "gemma3"   text-only Gemma 3: layer 0 slides (window 16), layer 1 full, each with its own
               RoPE base; q/k norms, query_pre_attn_scalar 24, tied embeddings, final logit
               soft-capping at 1, random norm weights (transformers starts them at 0)

`config_overrides` are passed to the transformers config class (e.g. num_key_value_heads=1).
The weights use a larger init scale than transformers' default so greedy outputs vary instead of
repeating one token. The same (family, seed, overrides) always writes the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

FAMILIES = (
    "llama",
    "llama3",
    "qwen2",
    "mistral",
    "qwen3",
    "phi3",
    "qwen3_moe",
    "mixtral",
    "gemma3",
)

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def tiny_config(family: str = "llama", **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny model of `family` (see the module docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    kwargs = dict(_COMMON)
    if family == "llama3":
        kwargs["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    elif family == "qwen2":
        kwargs.update(tie_word_embeddings=True, use_sliding_window=False)
    elif family == "mistral":
        kwargs.update(num_key_value_heads=1, head_dim=16, sliding_window=32)
    elif family == "qwen3":
        kwargs.update(head_dim=16, use_sliding_window=False)
    elif family == "phi3":
        kwargs.update(pad_token_id=0)
    elif family == "qwen3_moe":
        kwargs.update(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    elif family == "mixtral":
        kwargs.update(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=24
        )
    elif family == "gemma3":
        kwargs.update(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            final_logit_softcapping=1.0,  # the logits are small: a low cap that bends them
            # the sqrt(hidden) embedding scale makes the default init's outputs repeat tokens
            initializer_range=0.03,
            tie_word_embeddings=True,
            pad_token_id=0,
        )
    kwargs.update(overrides)
    config_cls = {
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
        "qwen3": Qwen3Config,
        "phi3": Phi3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "gemma3": Gemma3TextConfig,
    }.get(family, LlamaConfig)
    return config_cls(**kwargs)


def make_tiny_model(
    tmp_path: str | Path,
    family: str = "llama",
    *,
    sharded: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Build a tiny random model of `family`, save it under `tmp_path/<family>`, return the dir.

    `sharded=True` splits the safetensors into several files with a `model.safetensors.index.json`.
    Weights are saved in float32; load them in any dtype.
    """
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "gemma3":  # its norms scale by (1 + weight), initialised to 0: vary them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    )
    model_dir = Path(tmp_path) / (family + ("-sharded" if sharded else ""))
    model.save_pretrained(model_dir, max_shard_size="100KB" if sharded else "50GB")
    return str(model_dir)


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The transformers reference model, with SDPA attention (it keeps float64 exact) and, for
    mixture-of-experts models, the per-expert loop (its grouped matmul refuses float64)."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa", experts_implementation="eager"
    )
    return model.eval()
