"""Turns one step's logits into token ids: greedy, temperature, top-k, top-p, per-request seeds.

Before picking, a request's processors (SamplingParams: logit_bias, min_tokens, then the
repetition, frequency and presence penalties, vLLM's order) change a copy of its logits row.

Reproducibility: the random draw for a request's n-th output token uses noise that is a function
of mix(seed, n) alone (engine/sampling_noise.py), never of a generator that carries state across
steps. So the same seed gives the same tokens whatever else shares the batch, and a preempted
request that is recomputed draws the same numbers again for the positions it still has to
generate. All rows draw in one batch, and a step reads its tokens back once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from engine.sampling_noise import exponentials, to_device
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, output_pos: int) -> int:
    """A 63-bit generator seed for (request seed, output position): splitmix64 of both.

    A plain `seed * K + pos` would make (seed, pos) and (seed + 1, pos - K) collide; splitmix64's
    avalanche makes nearby inputs give unrelated generator states.
    """
    z = (seed * 0x9E3779B97F4A7C15 + output_pos + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch.Generator.manual_seed wants a non-negative int64


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one sampled sequence of the batch."""

    params: SamplingParams
    seed: int  # the request's seed (drawn at admission when the user gave none)
    output_pos: int  # index of the token being sampled among the request's output tokens
    # For the processors only (left empty when the params have none): the request's tokens,
    # and the ids that min_tokens masks (EOS unless ignored, and the stop tokens).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_ids: Collection[int] = field(default_factory=tuple)


class Sampler:
    """Samples one token per logits row. Stateless: the same inputs give the same tokens."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """`logits`: [num_rows, vocab_size], one row per entry of `rows`; returns one id per row."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        if any(row.params.processes_logits for row in rows):
            logits = process_logits(logits, rows)
        # Greedy rows take one batched argmax; the random rows one batched draw with noise
        # from their own seeds (engine/sampling_noise.py); then one host sync for the step.
        token_ids = logits.argmax(dim=-1)
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_idx:
            index = to_device(random_idx, torch.long, logits.device)
            probs = filtered_probs(
                logits.index_select(0, index), [rows[i].params for i in random_idx]
            )
            seeds = [mix_seed(rows[i].seed, rows[i].output_pos) for i in random_idx]
            noise = exponentials(seeds, probs.shape[1], probs.dtype, probs.device)
            token_ids.index_copy_(0, index, (probs / noise).argmax(dim=-1))
        result: list[int] = token_ids.tolist()
        return result


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` [rows, vocab] with each row's processors applied."""
    logits = logits.clone()
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        params = row.params
        if not params.processes_logits:
            continue
        out = logits[i]  # a view: edited in place
        if params.logit_bias:
            ids = [t for t, _ in params.logit_bias if t < vocab_size]
            bias = [b for t, b in params.logit_bias if t < vocab_size]
            out[ids] += torch.tensor(bias, dtype=out.dtype, device=out.device)
        if row.output_pos < params.min_tokens and row.stop_ids:
            out[[t for t in row.stop_ids if t < vocab_size]] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), device=out.device
            )
            scores = out[seen]
            penalty = params.repetition_penalty
            out[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
        prior = params.prior_output_tokens  # output before a migration, now in the prompt
        counted = [*row.prompt_token_ids[len(row.prompt_token_ids) - prior :]] if prior else []
        counted += row.output_token_ids
        if (params.frequency_penalty or params.presence_penalty) and counted:
            output_ids = torch.tensor(counted, device=out.device)
            counts = torch.bincount(output_ids, minlength=vocab_size)[:vocab_size].to(out.dtype)
            out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
                out.dtype
            )
    return logits


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k and top-p sets, renormalized. [rows, vocab].

    Every row must have temperature > 0. top-k keeps the k largest logits; top-p then keeps the
    smallest set of the most likely tokens whose mass reaches p (the token that crosses p is in).
    """
    temperatures = to_device([p.temperature for p in params], logits.dtype, logits.device)
    scaled = logits / temperatures.unsqueeze(1)
    vocab_size = logits.shape[1]
    if all((p.top_k <= 0 or p.top_k >= vocab_size) and p.top_p >= 1.0 for p in params):
        return torch.softmax(scaled, dim=-1)

    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab]
    top_k = to_device(
        [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
        torch.long,
        logits.device,
    )
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    top_p = to_device([p.top_p for p in params], sorted_probs.dtype, logits.device)
    # Mass strictly before each token: the token is kept while that mass is still below p,
    # which keeps the smallest prefix of the sorted tokens whose mass is >= p (never empty).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_before < top_p.unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, sorted_ids, sorted_probs)


def draw(probs: torch.Tensor, seed: int) -> int:
    """One sample from `probs` [vocab] with the noise of `seed` (a mix_seed value): the
    exponential race argmax p_i / E_i, E_i ~ Exp(1), exactly as Sampler draws a row."""
    noise = exponentials([seed], probs.shape[-1], probs.dtype, probs.device)[0]
    return int((probs / noise).argmax())
