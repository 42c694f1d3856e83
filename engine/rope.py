"""Rotary position embeddings: one cos/sin table per model, indexed by positions once per step.

The table is computed exactly as transformers computes it (inverse frequencies and angles in
float32, cos/sin in float32, then cast to the model dtype), so that float64 runs match the
reference to rounding error. Rotation uses the "rotate half" convention of Llama/Qwen2/Mistral
checkpoints: the first and second halves of head_dim form the (x, y) pairs.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(rope_parameters: dict[str, Any], head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies for rope types default, linear and llama3."""
    base = float(rope_parameters["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope_parameters)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin for positions [0, max_positions): [max_positions, head_dim // 2] each."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_parameters: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inverse_frequencies(rope_parameters, head_dim)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [num_tokens, 1, head_dim // 2] each (broadcast on heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, num_heads, head_dim] (any strides) by cos/sin from `cos_sin`.

    Returns a new contiguous tensor; x1*cos - x2*sin is the same arithmetic as transformers'
    x*cos + rotate_half(x)*sin, so results agree bit for bit.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half])
    out[..., :half].sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:])
    out[..., half:].add_(x1 * sin)
    return out
