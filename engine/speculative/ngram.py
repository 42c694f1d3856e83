"""Prompt lookup (n-gram) proposals: copy what followed the last n tokens the previous time.

The search runs over the token ids as 4-byte little-endian integers with bytes.rfind (C speed,
a few microseconds for thousands of tokens), so the proposer costs next to nothing per step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("i").itemsize  # 4


def propose(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n tokens,
    for the longest n in [min_n, max_n] that occurs earlier; [] when none does."""
    total = len(token_ids)
    if num_tokens <= 0 or total < min_n + 1:
        return []
    haystack = array("i", token_ids).tobytes()
    # A match must end before the last token, so that at least one token follows it.
    search_end = (total - 1) * _WIDTH
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        needle = haystack[(total - n) * _WIDTH :]
        end = search_end
        while True:
            pos = haystack.rfind(needle, 0, end)
            if pos < 0:
                break
            if pos % _WIDTH == 0:
                start = pos // _WIDTH + n
                return list(token_ids[start : start + num_tokens])
            end = pos + len(needle) - 1  # an unaligned hit: look further left
    return []
