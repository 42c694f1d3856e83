"""The sampler, tested on logits: filters keep exactly the sets the definitions name, and the
empirical frequencies match softmax(logits / T) within a bound computed from the sample count."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, filtered_probs, mix_seed
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def _rows(params: SamplingParams, num_rows: int, seed: int = 0) -> list[SamplingRow]:
    """num_rows independent draws: one seed, successive output positions."""
    return [SamplingRow(params, seed, pos) for pos in range(num_rows)]


def _counts(token_ids: list[int], vocab_size: int) -> list[int]:
    return [token_ids.count(t) for t in range(vocab_size)]


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(), seed=i, output_pos=0) for i in range(5)]
    assert Sampler()(logits, rows) == logits.argmax(dim=-1).tolist()


def test_empirical_frequencies_match_softmax_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=torch.float64)
    temperature = 0.7
    num_samples = 4000
    params = SamplingParams(temperature=temperature)
    token_ids = Sampler()(logits.expand(num_samples, -1), _rows(params, num_samples, seed=3))
    expected = torch.softmax(logits / temperature, dim=-1).tolist()
    for count, p in zip(_counts(token_ids, len(expected)), expected, strict=True):
        # Binomial(n, p): a 5-sigma band fails by chance with probability < 1e-6 per token.
        bound = 5 * math.sqrt(num_samples * p * (1 - p)) + 1
        assert abs(count - num_samples * p) <= bound, (count, num_samples * p, bound)


def test_top_k_never_samples_outside_the_k_largest() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    top_ids = set(logits.topk(5).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=5)  # hot: without the filter all 40 appear
    token_ids = Sampler()(logits.expand(2000, -1), _rows(params, 2000))
    assert set(token_ids) == top_ids


def _smallest_top_set(probs: list[float], top_p: float) -> set[int]:
    """Brute force: the fewest most-likely tokens whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    mass, kept = 0.0, set()
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(top_p: float) -> None:
    logits = torch.randn(3, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=1.3, top_p=top_p)] * 3
    probs = filtered_probs(logits, params)
    for row in range(3):
        unfiltered = torch.softmax(logits[row] / 1.3, dim=-1).tolist()
        support = set(torch.nonzero(probs[row]).flatten().tolist())
        assert support == _smallest_top_set(unfiltered, top_p)
        # Renormalized, and proportional to the unfiltered probabilities inside the set.
        assert probs[row].sum().item() == pytest.approx(1.0, abs=1e-12)
        kept = sorted(support)
        ratio = probs[row, kept] / torch.tensor(unfiltered, dtype=torch.float64)[kept]
        assert torch.allclose(ratio, ratio[0].expand_as(ratio))


def test_top_k_then_top_p_compose() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]], dtype=torch.float64)
    # top-k 4 leaves 4 tokens; of those, the top 2 hold < 0.7 of the mass, the top 3 more.
    probs = filtered_probs(logits, [SamplingParams(temperature=1.0, top_k=4, top_p=0.7)])
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1, 2]


def test_low_temperature_approaches_argmax() -> None:
    logits = torch.tensor([[1.0, 1.2, 0.9, -0.5]], dtype=torch.float64)
    masses = [
        filtered_probs(logits, [SamplingParams(temperature=t)])[0, 1].item()
        for t in (1.0, 0.3, 0.1, 0.01)
    ]
    assert masses == sorted(masses)  # mass on the argmax grows as T falls
    assert masses[-1] > 1 - 1e-8


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=11)
    alone = [Sampler()(vocab[i : i + 1], [SamplingRow(params, 11, i)])[0] for i in range(8)]
    # Now inside a batch with other requests (greedy and seeded), in another order.
    other = SamplingParams(temperature=0.8, seed=99)
    rows: list[SamplingRow] = []
    batch_logits = []
    for i in reversed(range(8)):
        rows += [
            SamplingRow(params, 11, i),
            SamplingRow(other, 99, i),
            SamplingRow(SamplingParams(), 0, 0),
        ]
        batch_logits += [vocab[i], vocab[(i + 3) % 8], vocab[i]]
    mixed = Sampler()(torch.stack(batch_logits), rows)
    assert mixed[0::3] == list(reversed(alone))


def test_positions_and_seeds_give_different_draws() -> None:
    uniform = torch.zeros(200, 1000)
    params = SamplingParams(temperature=1.0)
    by_position = Sampler()(uniform, _rows(params, 200, seed=4))
    by_seed = Sampler()(uniform, [SamplingRow(params, s, 0) for s in range(200)])
    # 200 uniform draws from 1000 ids: > 150 distinct ids unless the draws are correlated.
    assert len(set(by_position)) > 150
    assert len(set(by_seed)) > 150
    assert len({mix_seed(s, p) for s in range(50) for p in range(50)}) == 2500


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(2, 5), [SamplingRow(SamplingParams(), 0, 0)])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", -3),
        ("stop_token_ids", (-1,)),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 9.9e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Dividing by 1e-45 (0 in float32) overflowed every logit, and every token came out as 0."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=temperature, top_p=0.9)
    assert params.greedy
    assert Sampler()(logits, _rows(params, 6)) == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy
