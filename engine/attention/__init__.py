"""Attention back ends behind one interface; `select_backend` is the one place that chooses."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend

# flash-attn's paged kernels take a block table only when the page size is a multiple of 256.
FLASH_BLOCK_SIZE_MULTIPLE = 256


def select_backend(device: torch.device | str, block_size: int) -> AttentionBackend:
    """flash-attn on CUDA where it is installed and the block size suits it; torch otherwise."""
    on_cuda = torch.device(device).type == "cuda"
    if (
        on_cuda
        and importlib.util.find_spec("flash_attn") is not None
        and block_size % FLASH_BLOCK_SIZE_MULTIPLE == 0
    ):
        from engine.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    return TorchAttentionBackend(cuda=on_cuda)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "build_attention_metadata",
    "select_backend",
]
