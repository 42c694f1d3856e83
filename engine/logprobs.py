"""Log-probabilities of sampled and prompt tokens, from one step's logits.

Both are log-softmax of the model's raw logits (before processors and temperature), as vLLM
reports them by default and as transformers' logits give them.

A chunk with `all_logits` (a prompt chunk of a request that asked for prompt log-probabilities)
has one logits row per token: the row at position t gives the log-probability of prompt token
t + 1. When the chunk samples, its last row (the last prompt token's) is the sampling row. The
prompt's log-probabilities gather on the Request, chunk by chunk, and leave with the output of
its first token, so a prefill instance ships them with that token and nothing else moves.

    logits: [batch.num_logits, vocab]  ──split_logits──▶  sampling rows [batch.num_sampled, vocab]
                                                          + each all_logits chunk's prompt rows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.batch import ScheduledBatch
from engine.outputs import StepOutput, TokenLogprob
from engine.request import Request
from engine.sampler import SamplingRow, process_logits


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """One TokenLogprob per row of `logits` [n, vocab] for the token of that row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)  # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    num_top = min(num_top, logits.shape[1])
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in token_ids]
    return [
        TokenLogprob(token_id, logprob, rank, top)
        for token_id, logprob, rank, top in zip(
            token_ids, chosen.squeeze(1).tolist(), ranks, tops, strict=True
        )
    ]


def split_logits(
    batch: ScheduledBatch, logits: torch.Tensor, requests: Mapping[str, Request]
) -> torch.Tensor:
    """The sampling rows of `logits`, in batch order; every all_logits chunk's prompt rows are
    turned into its request's prompt log-probabilities on the way."""
    if not any(chunk.all_logits for chunk in batch.chunks):
        return logits
    sample_rows: list[int] = []
    row = 0
    for chunk in batch.chunks:
        num_rows = chunk.num_logits
        if not chunk.all_logits:
            sample_rows.extend(range(row, row + num_rows))
        else:
            num_prompt_rows = num_rows - 1 if chunk.sample else num_rows
            request = requests.get(chunk.request_id)
            if num_prompt_rows and request is not None and request.prompt_logprobs is not None:
                start = chunk.start_pos + 1
                targets = request.prompt_token_ids[start : start + num_prompt_rows]
                num_top = request.params.prompt_logprobs or 0
                request.prompt_logprobs.extend(
                    token_logprobs(logits[row : row + num_prompt_rows], targets, num_top)
                )
            if chunk.sample:
                sample_rows.append(row + num_rows - 1)
        row += num_rows
    return logits[sample_rows]


def sampled_logprobs(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    sampled: Sequence[int],
) -> dict[str, TokenLogprob]:
    """request_id -> the log-probability of its sampled token, for requests that asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return {}
    request_ids = [chunk.request_id for chunk in batch.chunks if chunk.sample]
    num_top = max(rows[i].params.logprobs or 0 for i in wanted)
    found = token_logprobs(logits[wanted], [sampled[i] for i in wanted], num_top)
    result = {}
    for i, logprob in zip(wanted, found, strict=True):
        logprob.top = logprob.top[: rows[i].params.logprobs or 0]
        result[request_ids[i]] = logprob
    return result


def first_row_indices(drafts: Sequence[Sequence[int]]) -> list[int]:
    """In a verification step's logits (len(draft) + 1 rows per sampled chunk), each chunk's
    first row: the distribution of its first new token."""
    indices, offset = [], 0
    for draft in drafts:
        indices.append(offset)
        offset += len(draft) + 1
    return indices


def process_first_rows(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """A verification step's logits with the processors of the rows that have them applied.
    The scheduler proposes no tokens for such a request, so its one row is its first."""
    wanted = [i for i, row in enumerate(rows) if row.params.processes_logits]
    if not wanted:
        return logits
    assert all(not drafts[i] for i in wanted), "a request with processors got proposals"
    first = first_row_indices(drafts)
    index = torch.tensor([first[i] for i in wanted], dtype=torch.long, device=logits.device)
    processed = process_logits(logits.index_select(0, index), [rows[i] for i in wanted])
    return logits.index_copy(0, index, processed)


def attach_logprobs(
    outputs: Sequence[StepOutput],
    sampled: Mapping[str, TokenLogprob],
    first_tokens: Mapping[str, Request],
) -> None:
    """Put each output's token log-probability on it, and a request's prompt log-probabilities
    on the output of its first token (`first_tokens`: the requests whose last prompt chunk
    sampled this step)."""
    for output in outputs:
        if not output.new_token_ids:
            continue
        logprob = sampled.get(output.request_id)
        if logprob is not None:
            output.logprobs = [logprob]
        request = first_tokens.get(output.request_id)
        if request is not None and request.prompt_logprobs is not None:
            output.prompt_logprobs = request.prompt_logprobs
