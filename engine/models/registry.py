"""Hugging Face `architectures` name -> our model class. The one list of what pdserve runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # reading the list (deploy's config checks) must not import torch
    from torch import nn

# Class paths, imported lazily so that reading a config does not build any torch module.
_MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("engine.models.phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma3", "Gemma3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASSES)


def unsupported_message(architectures: list[str] | str) -> str:
    return (
        f"model architecture {architectures} is not supported by pdserve; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def get_model_class(architecture: str) -> type[nn.Module]:
    """Our implementation of `architecture`; ValueError naming the supported ones otherwise."""
    if architecture not in _MODEL_CLASSES:
        raise ValueError(unsupported_message(architecture))
    module_name, class_name = _MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(module_name), class_name)
