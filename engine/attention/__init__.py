"""Attention back ends behind one interface; `select_backend` is the one place that chooses."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import check_runnable

# flash-attn's paged kernels take a block table only when the page size is a multiple of 256.
FLASH_BLOCK_SIZE_MULTIPLE = 256


ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")


def select_backend(
    device: torch.device | str, block_size: int, name: str = "auto"
) -> AttentionBackend:
    """The back end called `name`; "auto" picks flash-attn on CUDA where it is installed and the
    block size suits it, else the Triton kernels on CUDA where triton is installed, else torch."""
    on_cuda = torch.device(device).type == "cuda"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention back end {name!r} is not one of {ATTENTION_BACKENDS}")
    if name == "auto":
        flash_fits = block_size % FLASH_BLOCK_SIZE_MULTIPLE == 0 and _installed("flash_attn")
        if on_cuda and flash_fits:
            name = "flash"
        else:
            name = "triton" if on_cuda and _installed("triton") else "torch"
    if name == "flash":
        if not on_cuda or block_size % FLASH_BLOCK_SIZE_MULTIPLE:
            raise ValueError(
                f"the flash back end needs CUDA and a block size that is a multiple of "
                f"{FLASH_BLOCK_SIZE_MULTIPLE}"
            )
        from engine.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    if name == "triton":
        check_runnable(torch.device(device).type, "the triton attention back end")
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(cuda=on_cuda)
    return TorchAttentionBackend(cuda=on_cuda)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "build_attention_metadata",
    "select_backend",
]
