"""Turning a verification step's logits into each request's new tokens.

A sampled chunk with k proposed tokens d1..dk has k + 1 logits rows: row j is the target's
distribution for the token after d_j (row 0: after the request's last token). The new tokens
are d1..dn, the longest prefix the target accepts, then one token of the target's own (the
correction at the first rejection, or a bonus token after all k): between 1 and k + 1 tokens.

Greedy: d_j is accepted while it is the argmax of row j-1; the token after is that row's argmax,
so the output is exactly what non-speculative greedy decoding gives.

Sampling (Leviathan et al. 2023, Chen et al. 2023) with a point-mass proposal q = 1[d_j]: accept
d_j with probability p_j(d_j); on rejection draw from the residual max(0, p_j - q), which is p_j
with d_j removed, renormalized. Each emitted token is then distributed as p exactly. The
probabilities are the ones the sampler uses (temperature, top-k, top-p), and every random number
for output position i is a function of mix_seed(seed, i) (engine/sampling_noise.py), so a seeded
request is reproducible and a chunk with no proposals draws exactly as the plain sampler does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampler import SamplingRow, draw, filtered_probs, mix_seed
from engine.sampling_noise import uniforms


def verify(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
) -> list[list[int]]:
    """`logits` [sum(len(d) + 1 for d in drafts), vocab]; one row (SamplingRow) and one list
    of proposed tokens per sampled chunk. Returns each chunk's new tokens, in order."""
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows or len(rows) != len(drafts):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows with "
            f"{num_rows - len(drafts)} proposed tokens"
        )
    argmax: list[int] = logits.argmax(dim=-1).tolist()
    results: list[list[int]] = []
    offset = 0
    for row, draft in zip(rows, drafts, strict=True):
        size = len(draft) + 1
        if row.params.greedy:
            results.append(_greedy(argmax[offset : offset + size], draft))
        else:
            results.append(_rejection_sample(logits[offset : offset + size], row, draft))
        offset += size
    return results


def _greedy(targets: list[int], draft: Sequence[int]) -> list[int]:
    for j, token in enumerate(draft):
        if targets[j] != token:
            return targets[: j + 1]
    return targets


def _rejection_sample(logits: torch.Tensor, row: SamplingRow, draft: Sequence[int]) -> list[int]:
    probs = filtered_probs(logits, [row.params] * logits.shape[0])
    out: list[int] = []
    for j, token in enumerate(draft):
        seed = mix_seed(row.seed, row.output_pos + j)
        p_token = float(probs[j, token])
        # the acceptance test's uniform: its own stream (salt 1) of the position's seed
        uniform = float(uniforms([seed], 1, torch.float64, probs.device, salt=1)[0, 0])
        if uniform < p_token:
            out.append(token)
            continue
        residual = probs[j].clone()
        residual[token] = 0.0  # max(0, p - q) for q the point mass on the proposed token
        out.append(draw(residual / residual.sum(), seed))
        return out
    out.append(draw(probs[-1], mix_seed(row.seed, row.output_pos + len(draft))))
    return out
