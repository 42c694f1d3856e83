"""Rejection sampling keeps the target distribution: chi-square goodness-of-fit tests at
significance 0.001 (fixed seeds, so each test's outcome is deterministic).

1. The verifier alone, on fixed logits: the first emitted token after a point-mass proposal is
   distributed as the target's (filtered) probabilities, for a likely and an unlikely proposal;
   and after a proposal drawn from a draft distribution q, with q passed to the verifier.
2. End to end on a tiny-vocabulary model (6 tokens) at temperature 1: 3000 seeded requests whose
   prompt repeats itself, so prompt lookup proposes from the first decode step; and the same
   with a draft model (the target's first layer) that samples its proposals. The joint
   distribution of their first three tokens is compared with the exact one from transformers in
   float64, with speculation on and, as a control of the test itself, off.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.sampler import SamplingRow, filtered_probs
from engine.speculative.config import SpeculativeConfig
from engine.speculative.layer_skip import build_layer_skip_draft
from engine.speculative.verify import verify
from tests.tiny_models import load_hf_model

ALPHA = 0.001
VOCAB = 6
PROMPT = [3, 4, 5, 0, 3, 4, 5, 0, 3, 4]


def chi_square_p(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """p-value of `counts` under `probs`; cells expecting fewer than 5 are pooled into one."""
    total = sum(counts.values())
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, "a zero-probability outcome"
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for key, p in probs.items():
        if p * total >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * total)
        else:
            pooled_o += counts.get(key, 0)
            pooled_e += p * total
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    scale = total / sum(expected)  # float rounding of probs that sum to 1
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        (SamplingParams(temperature=1.0), [1, 4]),  # a likely proposal
        (SamplingParams(temperature=0.7), [4, 1]),  # an unlikely one
        (SamplingParams(temperature=1.3, top_k=4, top_p=0.9), [0, 0]),
    ],
)
def test_first_token_follows_the_target(params: SamplingParams, draft: list[int]) -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, -0.5]] * 3, dtype=torch.float64)
    probs = filtered_probs(logits[:1], [params])[0].tolist()
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(20000):
        (tokens,) = verify(logits, [SamplingRow(params, seed, 0)], [draft])
        counts[(tokens[0],)] = counts.get((tokens[0],), 0) + 1
        accepted += tokens[0] == draft[0]
    assert 0 < accepted < 20000
    assert chi_square_p(counts, {(t,): p for t, p in enumerate(probs)}) > ALPHA


def test_first_token_follows_the_target_after_a_draft_distribution() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, -0.5]] * 2, dtype=torch.float64)
    probs = filtered_probs(logits[:1], [params])[0].tolist()
    q = torch.tensor([[0.1, 0.1, 0.5, 0.2, 0.1]], dtype=torch.float64)  # favours token 2
    generator = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(20000):
        proposal = int(torch.multinomial(q[0], 1, generator=generator))
        (tokens,) = verify(logits, [SamplingRow(params, seed, 0)], [[proposal]], [q])
        counts[(tokens[0],)] = counts.get((tokens[0],), 0) + 1
        accepted += tokens[0] == proposal
    assert 0 < accepted < 20000
    assert chi_square_p(counts, {(t,): p for t, p in enumerate(probs)}) > ALPHA


def exact_first_tokens(model_dir: str, num_tokens: int) -> dict[tuple[int, ...], float]:
    """P(first `num_tokens` outputs) at temperature 1, from transformers in float64."""
    hf = load_hf_model(model_dir, torch.float64)
    result: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=num_tokens - 1):
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0]
            steps = torch.softmax(logits[len(PROMPT) - 1 :], dim=-1)
            p_prefix = 1.0
            for i, token in enumerate(prefix):
                p_prefix *= float(steps[i, token])
            for last in range(VOCAB):
                result[(*prefix, last)] = p_prefix * float(steps[-1, last])
    return result


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft", None])
def test_sampled_outputs_follow_the_target(tiny_model, tmp_path, method: str | None) -> None:
    model_dir = tiny_model("llama", vocab_size=VOCAB)
    num_seeds, num_tokens = 3000, 3
    exact = exact_first_tokens(model_dir, num_tokens)
    spec = None
    if method == "ngram":
        spec = SpeculativeConfig(num_tokens=3, prompt_lookup_max=3)
    elif method == "draft":
        draft_dir = build_layer_skip_draft(model_dir, tmp_path / "draft", 1)
        spec = SpeculativeConfig(method="draft", draft_model=draft_dir, num_tokens=3)
    speculative = spec is not None
    params = [
        SamplingParams(max_tokens=num_tokens + 1, temperature=1.0, seed=s, ignore_eos=True)
        for s in range(num_seeds)
    ]
    with LLM(model_dir, dtype="float64", block_size=8, max_num_seqs=256, speculative=spec) as llm:
        outputs = llm.generate([PROMPT] * num_seeds, params)
        speculator = llm.engine.scheduler.speculator
        if speculative:
            assert speculator is not None
            assert 0 < speculator.num_accepted < speculator.num_proposed
        again = llm.generate([PROMPT] * 20, params[:20])  # seeded: reproducible
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs[:20]]
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        key = tuple(out.token_ids[:num_tokens])
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact) > ALPHA
