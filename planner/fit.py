"""Least-squares fits of the latency model from measured step times (numpy.linalg.lstsq)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.profile import DEFAULT_THRESHOLD, Triple

# A disturbed measurement (another process on the core, the host taking the vCPU) is only ever
# slower: one that is slower than the fit of the others by more than this many robust standard
# deviations of their relative residuals (and more than MIN_OUTLIER) is left out, and the rest
# fitted again. A profile's few points per context otherwise carry one disturbed window into
# the intercept (a decode point at batch 1 measured 17.2 ms where its neighbours took 11-12).
OUTLIER_SIGMAS = 4.0
MIN_OUTLIER = 0.05
MAX_REFITS = 3


def _lstsq(columns: list[np.ndarray], times_ms: np.ndarray) -> np.ndarray:
    """Least squares on relative error (a step time's noise grows with it), without slow
    outliers (see OUTLIER_SIGMAS)."""
    design = np.stack(columns, axis=1)
    weights = 1.0 / np.maximum(np.abs(times_ms), 1e-9)
    keep = np.ones(len(times_ms), dtype=bool)
    for _ in range(MAX_REFITS + 1):
        coeffs, *_ = np.linalg.lstsq(
            design[keep] * weights[keep, None], times_ms[keep] * weights[keep], rcond=None
        )
        relative = (times_ms - design @ coeffs) * weights
        spread = 1.4826 * np.median(np.abs(relative[keep] - np.median(relative[keep])))
        fits = relative <= max(OUTLIER_SIGMAS * spread, MIN_OUTLIER)
        if fits.sum() < design.shape[1] + 2 or np.array_equal(fits, keep):
            break
        keep = fits
    return coeffs


def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> Triple:
    """[a, b, c] of a + b*Σl + c*Σl² from (prompt lengths of a batch, ms) samples."""
    if len(samples) < 3:
        raise ValueError(f"fitting a prefill triple needs >= 3 samples, got {len(samples)}")
    sum_len = np.array([float(sum(lens)) for lens, _ in samples])
    sum_sq = np.array([float(sum(x * x for x in lens)) for lens, _ in samples])
    times = np.array([t for _, t in samples], dtype=float)
    a, b, c = _lstsq([np.ones_like(sum_len), sum_len, sum_sq], times)
    return (float(a), float(b), float(c))


def _fit_decode_part(samples: Sequence[tuple[int, int, float]]) -> Triple:
    batch = np.array([float(b) for b, _, _ in samples])
    tokens = np.array([float(s + b) for b, s, _ in samples])  # Σ(ctx + 1)
    times = np.array([t for _, _, t in samples], dtype=float)
    a, b, c = _lstsq([np.ones_like(batch), tokens, batch], times)
    return (float(a), float(b), float(c))


def fit_decode(
    samples: Sequence[tuple[int, int, float]], threshold: int = DEFAULT_THRESHOLD
) -> tuple[Triple, Triple]:
    """(small-batch, large-batch) triples of a + b*Σ(ctx+1) + c*B from (B, Σctx, ms) samples.

    A side with fewer than 3 samples takes the other side's fit (a profile run on a small
    machine may never reach the threshold's batch size).
    """
    small = [s for s in samples if s[0] < threshold]
    large = [s for s in samples if s[0] >= threshold]
    if len(small) < 3 and len(large) < 3:
        raise ValueError(f"fitting decode needs >= 3 samples on one side, got {len(samples)}")
    small_fit = _fit_decode_part(small) if len(small) >= 3 else None
    large_fit = _fit_decode_part(large) if len(large) >= 3 else None
    return (small_fit or large_fit, large_fit or small_fit)  # type: ignore[return-value]


def fit_decode_by_batch(
    samples: Sequence[tuple[int, int, float]], triple: Triple, max_batch: int
) -> dict[int, float]:
    """{B: the step's constant part at batch B} for every B <= `max_batch` measured, from
    (B, Σctx, ms) samples less the triple's context term b*Σ(ctx+1)."""
    batches = sorted({b for b, _, _ in samples if b <= max_batch})
    if not batches:
        return {}
    chosen = [s for s in samples if s[0] <= max_batch]
    _, per_token, _ = triple
    rest = np.array([t - per_token * (s + b) for b, s, t in chosen], dtype=float)
    columns = [np.array([float(b == batch) for b, _, _ in chosen]) for batch in batches]
    return {b: float(ms) for b, ms in zip(batches, _lstsq(columns, rest), strict=True)}


def fit_mixed(samples: Sequence[tuple[int, int, int, int, float]], decode: Triple) -> Triple:
    """(a', b', c') of a mixed step's prompt part from (B, Σctx, Σm, Σ(m² + 2mp), ms) samples:
    what each step took beyond its decodes' b*Σ(ctx+1) + c*B (the fitted decode triple)."""
    if len(samples) < 3:
        raise ValueError(f"fitting mixed steps needs >= 3 samples, got {len(samples)}")
    _, bd, cd = decode
    chunk = np.array([float(m) for _, _, m, _, _ in samples])
    attn = np.array([float(q) for _, _, _, q, _ in samples])
    rest = np.array([t - bd * (s + b) - cd * b for b, s, _, _, t in samples], dtype=float)
    a, b, c = _lstsq([np.ones_like(chunk), chunk, attn], rest)
    return (float(a), float(b), float(c))


def fit_transfer(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth GB/s, per-message ms) from (bytes moved, ms) samples."""
    if len(samples) < 2:
        raise ValueError(f"fitting a transfer needs >= 2 sizes, got {len(samples)}")
    sizes = np.array([float(n) for n, _ in samples])
    times = np.array([t for _, t in samples], dtype=float)
    per_message, ms_per_byte = _lstsq([np.ones_like(sizes), sizes], times)
    if ms_per_byte <= 0:
        raise ValueError("the transfer times do not grow with size; measure larger sizes")
    return (float(1.0 / (ms_per_byte * 1e6)), float(max(per_message, 0.0)))
