"""Tiny random-weight Hugging Face models, saved with `save_pretrained`, for tests on CPU.

    make_tiny_model(tmp_path, family="llama", sharded=False, **config_overrides) -> model_dir

Families (all small: hidden 64, 2 layers, vocab 512):
    "llama"    Llama-2 style, GQA (4 query heads, 2 KV heads), default RoPE
    "llama3"   Llama-3 style, GQA, rope_type "llama3" with a short original context so the
               frequency scaling actually changes some frequencies
    "qwen2"    q/k/v bias, tied input/output embeddings
    "mistral"  one KV head, explicit head_dim, sliding window of 32 tokens

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
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

FAMILIES = ("llama", "llama3", "qwen2", "mistral")

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
    kwargs.update(overrides)
    config_cls = {"qwen2": Qwen2Config, "mistral": MistralConfig}.get(family, LlamaConfig)
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
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    )
    model_dir = Path(tmp_path) / (family + ("-sharded" if sharded else ""))
    model.save_pretrained(model_dir, max_shard_size="100KB" if sharded else "50GB")
    return str(model_dir)


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The transformers reference model, with SDPA attention (it keeps float64 exact)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.eval()
