"""Incremental detokenizing: turn a growing list of token ids into text deltas.

Invariant: the concatenation of every delta (with `flush()` at the end) equals
`tokenizer.decode(all_token_ids)`, and no delta ends in the middle of a multi-byte character.

Byte-level tokenizers split characters across tokens ("中" may be two tokens, the first decoding
to U+FFFD), and some tokenizers decode a token differently depending on what precedes it. So each
step decodes a short window of ids,

    token_ids:  ... | prefix_offset ..... read_offset | new ids |
                      context, already emitted          to emit

and emits the text the new ids add to the window's context, unless that text ends in U+FFFD,
which means a character is still incomplete: then it waits for more ids. The cost per token is a
decode of a few ids, not of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_IDS = 4  # ids decoded before read_offset, so context-dependent decoding stays right


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one sequence's output ids (the prompt is not part of the text)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.num_chars = 0  # characters emitted so far

    def num_ids_through(self, num_chars: int) -> int:
        """The fewest leading output ids whose text reaches `num_chars` characters (a stop
        string's end): the tokens a cut at that character keeps."""
        low, high = 0, len(self.token_ids)
        while low < high:
            middle = (low + high) // 2
            if len(self._tokenizer.decode(self.token_ids[:middle])) >= num_chars:
                high = middle
            else:
                low = middle + 1
        return low

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back; an incomplete character decodes to U+FFFD here."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset :]
        context_text = self._tokenizer.decode(window[: self._read_offset - self._prefix_offset])
        window_text = self._tokenizer.decode(window)
        if not final and window_text.endswith(REPLACEMENT_CHAR):
            return ""
        # The context ended on a complete character when it was emitted, so decoding more ids
        # after it only appends: the delta is what follows the context's text.
        delta = window_text[len(context_text) :]
        self._prefix_offset = max(self._read_offset - _NUM_CONTEXT_IDS, 0)
        self._read_offset = len(self.token_ids)
        self.num_chars += len(delta)
        return delta
