"""Counter-based random numbers for sampling: one batched computation for every seeded row.

The number for (row seed s, column j) is a hash of both, so a whole step's noise is a few
elementwise ops over [rows, vocab] with no generator objects and no host sync, and it depends
only on (s, j): the same seed draws the same token whatever else shares the batch, on any
device (the integer hash is exact, so CPU and GPU agree bit for bit on the uniforms).

    key[s]     = fmix32(lo32(s) ^ fmix32(hi32(s) ^ salt))     per row, on the host
    column[j]  = fmix32(j * golden)                           per column, once per vocab size
    bits[s, j] = fmix32(key[s] ^ column[j])
    u          = (bits >> 8 + 0.5) / 2**24                    in (0, 1), never 0 or 1 (in a
                                                              narrow dtype, clamped below 1)

fmix32 is MurmurHash3's finaliser, a bijection with full avalanche. On tensors it runs on int32
holding the 32 bits (two's complement: a product wraps modulo 2**32 as the hash wants, and a
right shift is masked to be logical), a third of the work of the same hash on int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_columns: dict[tuple[int, torch.device], torch.Tensor] = {}


def _signed(value: int) -> int:
    """The int32 holding these 32 bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """fmix32 of int32 `h` (its bits), in place."""
    h ^= (h >> 16) & 0xFFFF
    h *= _signed(_C1)
    h ^= (h >> 13) & 0x7FFFF
    h *= _signed(_C2)
    h ^= (h >> 16) & 0xFFFF
    return h


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 13
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def row_key(seed: int, salt: int = 0) -> int:
    """The 32-bit key of a 63-bit seed (engine.sampler.mix_seed's output) and a stream salt."""
    return _fmix32_int((seed & _M32) ^ _fmix32_int(((seed >> 32) ^ salt) & _M32))


def _column_hashes(width: int, device: torch.device) -> torch.Tensor:
    cached = _columns.get((width, device))
    if cached is None:
        hashes = [_signed(_fmix32_int((j * _GOLDEN) & _M32)) for j in range(width)]
        cached = torch.tensor(hashes, dtype=torch.int32).to(device)
        _columns[(width, device)] = cached
    return cached


def uniforms(
    seeds: Sequence[int],
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
    salt: int = 0,
) -> torch.Tensor:
    """[len(seeds), width] uniforms in (0, 1), row i a function of (seeds[i], salt) alone."""
    device = torch.device(device)
    keys = to_device([_signed(row_key(s, salt)) for s in seeds], torch.int32, device)
    bits = _fmix32(keys.unsqueeze(1) ^ _column_hashes(width, device))
    u = ((bits >> 8) & 0xFFFFFF).to(dtype).add_(0.5).mul_(2.0**-24)
    # In float32 (and narrower) x + 0.5 rounds up to 2**24 for the largest x: u would be 1, its
    # exponential 0, and p / 0 for a token of probability 0 (masked by a grammar, cut by top-k)
    # NaN, which argmax picks. The largest value below 1 instead (float64 never rounds here).
    return u.clamp_(max=_below_one(dtype))


def _below_one(dtype: torch.dtype) -> float:
    one = torch.tensor(1.0, dtype=dtype)
    return float(torch.nextafter(one, torch.tensor(0.0, dtype=dtype)))


def exponentials(
    seeds: Sequence[int], width: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[len(seeds), width] Exp(1) noise (-log of the uniforms: never 0, never infinite)."""
    return uniforms(seeds, width, dtype, device).log_().neg_()


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`: through pinned memory and a non-blocking copy on CUDA (a
    pageable copy would wait for the GPU to finish the step)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
