"""The counter-based sampling noise (engine/sampling_noise.py): exact integer hashing, uniforms
in (0, 1) that depend on their own seed alone, and the sampler's batched draw equal to one row's."""

from __future__ import annotations

import random

import torch

from engine.sampler import Sampler, SamplingRow, draw, filtered_probs, mix_seed
from engine.sampling_noise import _fmix32, _fmix32_int, _signed, exponentials, uniforms
from engine.sampling_params import SamplingParams


def test_the_tensor_hash_is_the_integer_hash() -> None:
    rng = random.Random(0)
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    tensor = torch.tensor([_signed(v) for v in values], dtype=torch.int32)
    assert _fmix32(tensor).tolist() == [_signed(_fmix32_int(v)) for v in values]


def test_uniforms_depend_on_their_own_seed_alone() -> None:
    seeds = [mix_seed(s, p) for s in range(3) for p in range(3)]
    batch = uniforms(seeds, 5000, torch.float64, "cpu")
    assert 0.0 < batch.min().item() and batch.max().item() < 1.0
    assert abs(batch.mean().item() - 0.5) < 0.01
    for i, seed in enumerate(seeds):
        assert torch.equal(uniforms([seed], 5000, torch.float64, "cpu")[0], batch[i])
    assert not torch.equal(uniforms(seeds[:1], 50, torch.float64, "cpu", salt=1)[0], batch[0, :50])
    noise = exponentials(seeds, 5000, torch.float64, "cpu")
    assert abs(noise.mean().item() - 1.0) < 0.02 and torch.isfinite(noise).all()


def test_the_batched_draw_is_the_one_row_draw() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [SamplingParams(temperature=0.6), SamplingParams(), SamplingParams(top_p=0.8)] * 2
    rows = [SamplingRow(p, seed=10 + i, output_pos=i) for i, p in enumerate(params)]
    tokens = Sampler()(logits, rows)
    for i, row in enumerate(rows):
        if row.params.greedy:
            assert tokens[i] == int(logits[i].argmax())
        else:
            probs = filtered_probs(logits[i : i + 1], [row.params])[0]
            assert tokens[i] == draw(probs, mix_seed(row.seed, row.output_pos))


def test_float32_noise_never_reaches_one_so_a_zero_probability_is_never_drawn() -> None:
    # seed 210's uniform at column 25386 rounds to 1 in float32 without the clamp
    u = uniforms([210], 49152, torch.float32, "cpu")
    assert float(u.max()) < 1.0 and float(u[0, 25386]) == float(u.max())
    assert bool((exponentials([210], 49152, torch.float32, "cpu") > 0).all())
    probs = torch.full((49152,), 1.0 / 49151)
    probs[25386] = 0.0  # a token a grammar masks
    assert draw(probs, 210) != 25386
