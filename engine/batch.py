"""What the scheduler hands the model runner for one step: plain data, picklable across processes
(the TP driver broadcasts it to the other ranks).

A step's batch is a list of chunks, one per scheduled sequence. A chunk is `token_ids` at
positions [start_pos, start_pos + len(token_ids)); the KV of positions [0, start_pos) is already in
the blocks of `block_table`, and the new tokens' KV is written into the same table (which already
holds enough blocks for start_pos + len(token_ids) tokens). A decode step is a chunk of length 1;
a speculative decode ends with `num_draft` proposed tokens and wants the logits of its last
num_draft + 1 tokens (engine/speculative/). A prompt chunk of a request that wants prompt
log-probabilities (`all_logits`) gets one logits row per token; its last is the sampled one's when
the chunk samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceChunk:
    request_id: str
    token_ids: list[int]  # the new tokens to compute this step
    start_pos: int  # how many tokens of this sequence already have KV
    block_table: list[int]
    # Whether the logits of the chunk's last token are wanted (False for a non-final prefill chunk).
    sample: bool = True
    num_draft: int = 0  # proposed tokens at the end of token_ids, verified this step
    all_logits: bool = False  # a logits row for every token (prompt log-probabilities)

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk gets: 0, 1, one per proposed token plus one, or one per token."""
        if self.all_logits:
            return len(self.token_ids)
        return self.num_draft + 1 if self.sample else 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens with KV after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass
class ScheduledBatch:
    chunks: list[SequenceChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_sampled(self) -> int:
        return sum(1 for c in self.chunks if c.sample)

    @property
    def num_logits(self) -> int:
        """Rows of the step's logits: num_sampled plus every proposed token and prompt row."""
        return sum(c.num_logits for c in self.chunks)

    @property
    def num_draft(self) -> int:
        return sum(c.num_draft for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)
