"""Stop strings over streamed text: cut exactly at the first match, even one split across tokens.

"First" is the occurrence that ends first (the one a reader going character by character would
meet first; on a tie, the longer string). So the result does not depend on how the text was cut
into deltas.

Text that could still turn out to be the start of a stop string is held back, so a client never
receives characters that a later token shows to belong to a stop string:

    emitted ........ | held (a suffix that is a prefix of some stop string) | new delta

A match must start inside `held + delta` (if it started earlier, the emitted text would have
ended in a prefix of it, and that prefix would have been held), so only that tail is searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # text safe to emit now
    stop_string: str | None = None  # set when a stop string matched: the text ends before it
    num_after: int = 0  # characters of what was fed that come after the stop string's end


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stop_strings = tuple(stop_strings)
        self._max_held = max((len(s) - 1 for s in self._stop_strings), default=0)
        self._held = ""

    def add(self, delta: str) -> StopCheck:
        """Feed a text delta; returns what can be emitted and whether a stop string matched."""
        if not self._stop_strings:
            return StopCheck(delta)
        tail = self._held + delta
        match = self._first_match(tail)
        if match is not None:
            position, stop_string = match
            self._held = ""
            num_after = len(tail) - position - len(stop_string)
            return StopCheck(tail[:position], stop_string, num_after)
        num_held = self._longest_partial_suffix(tail)
        self._held = tail[len(tail) - num_held :]
        return StopCheck(tail[: len(tail) - num_held])

    def flush(self) -> str:
        """At the end of the sequence, held text is plain text after all."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first; ties go to the longer one."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_string in self._stop_strings:
            start = text.find(stop_string)
            if start >= 0:
                candidate = (start + len(stop_string), -len(stop_string), stop_string)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[0] + best[1], best[2])

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for length in range(min(self._max_held, len(text)), 0, -1):
            suffix = text[len(text) - length :]
            if any(s.startswith(suffix) for s in self._stop_strings):
                return length
        return 0
