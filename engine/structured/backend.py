"""The interface a structured-output library implements, so that another (llguidance) can be added.

A backend compiles a StructuredOutput once into an opaque grammar, and makes matchers from it.
A matcher follows one sequence token by token and fills that sequence's row of a token bitmask:
32 tokens per int32 word, bit `t % 32` of word `t // 32` set when token t is allowed (xgrammar's
and llguidance's layout alike). The engine fills one bitmask for the batch and the backend
applies it in one call (grammars.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.structured.spec import StructuredOutput


class GrammarError(ValueError):
    """The spec does not compile (a bad schema, regex or grammar); the message says why."""


class Matcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and no change) when the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""

    @property
    def terminated(self) -> bool:
        """The grammar ended: it accepted a stop token, or admits nothing more."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutput) -> object:
        """The compiled grammar; raises GrammarError. May run on any thread."""

    def matcher(self, compiled: object) -> Matcher: ...

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 bitmask [num_rows, ceil(vocab_size / 32)] on the CPU, every token allowed."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, each token `bitmask` refuses in the `rows` of `logits`
        [n, vocab] (bitmask row i masks logits row i)."""
