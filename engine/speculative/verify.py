"""Turning a verification step's logits into each request's new tokens.

A sampled chunk with k proposed tokens d1..dk has k + 1 logits rows: row j is the target's
distribution for the token after d_j (row 0: after the request's last token). The new tokens
are d1..dn, the longest prefix the target accepts, then one token of the target's own (the
correction at the first rejection, or a bonus token after all k): between 1 and k + 1 tokens.

Greedy: d_j is accepted while it is the argmax of row j-1; the token after is that row's argmax,
so the output is exactly what non-speculative greedy decoding gives.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); on rejection draw from the residual max(0, p_j - q_j), renormalized.
Each emitted token is then distributed as p exactly. A draft model passes its distributions q
[k, vocab]; prompt lookup proposes a point mass q = 1[d_j] (None here): accept with probability
p_j(d_j), and the residual is p_j with d_j removed. The
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
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[list[int]]:
    """`logits` [sum(len(d) + 1 for d in drafts), vocab]; one row (SamplingRow) and one list
    of proposed tokens per sampled chunk, and optionally the distribution each draft was drawn
    from ([>= len(d), vocab], None for a point mass). Returns each chunk's new tokens, in order."""
    if draft_probs is None:
        draft_probs = [None] * len(drafts)
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows or len(rows) != len(drafts):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows with "
            f"{num_rows - len(drafts)} proposed tokens"
        )
    argmax: list[int] = logits.argmax(dim=-1).tolist()
    results: list[list[int]] = []
    offset = 0
    for row, draft, q in zip(rows, drafts, draft_probs, strict=True):
        size = len(draft) + 1
        if row.params.greedy:
            results.append(_greedy(argmax[offset : offset + size], draft))
        else:
            results.append(_rejection_sample(logits[offset : offset + size], row, draft, q))
        offset += size
    return results


def _greedy(targets: list[int], draft: Sequence[int]) -> list[int]:
    for j, token in enumerate(draft):
        if targets[j] != token:
            return targets[: j + 1]
    return targets


def _rejection_sample(
    logits: torch.Tensor, row: SamplingRow, draft: Sequence[int], q: torch.Tensor | None
) -> list[int]:
    probs = filtered_probs(logits, [row.params] * logits.shape[0])
    out: list[int] = []
    for j, token in enumerate(draft):
        seed = mix_seed(row.seed, row.output_pos + j)
        p_token = float(probs[j, token])
        # the acceptance test's uniform: its own stream (salt 1) of the position's seed
        uniform = float(uniforms([seed], 1, torch.float64, probs.device, salt=1)[0, 0])
        q_token = 1.0 if q is None else float(q[j, token])
        if uniform * q_token < p_token:  # u < min(1, p / q)
            out.append(token)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[token] = 0.0  # max(0, p - q) for q the point mass on the proposed token
        else:
            residual = (probs[j] - q[j].to(probs.dtype)).clamp_(min=0.0)
        total = float(residual.sum())
        # total 0 only where p == q, whose rejection has probability 0: float rounding
        out.append(draw(residual / total if total > 0 else probs[j], seed))
        return out
    out.append(draw(probs[-1], mix_seed(row.seed, row.output_pos + len(draft))))
    return out
