"""Mistral: the Llama block with a sliding attention window on every layer (from the config)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
