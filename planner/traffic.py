"""Synthetic traffic: arrival gaps and prompt/output lengths, from a fixed seed.

Arrivals are a renewal process at rate λ: Poisson (exponential gaps) or gamma gaps with a given
coefficient of variation (cv = 1 is Poisson; cv > 1 is burstier). The gaps are drawn once at
rate 1 and divided by λ, so every rate of a sweep replays the same sequence of requests, only
compressed in time (the comparison between rates and layouts is paired).

The planner simulates these shapes and the benchmark (benchmarks/goodput/workloads.py) sends
them, so a plan and a measurement see the same traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class LengthShape:
    """A synthetic traffic shape: log-normal prompt and output lengths (median, sigma), clipped.

    `ttft_slo_factor` / `tpot_slo_factor` set the shape's SLOs as multiples of this machine's
    unloaded latencies (benchmarks/goodput/calibrate.py): how tight each SLO is relative to
    the work, in the spirit of DistServe's per-application SLOs (REFERENCES.md).
    """

    name: str
    prompt_median: int
    prompt_sigma: float
    prompt_range: tuple[int, int]
    output_median: int
    output_sigma: float
    output_range: tuple[int, int]
    ttft_slo_factor: float
    tpot_slo_factor: float
    source: str

    def __post_init__(self) -> None:
        for name in ("prompt_range", "output_range"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{self.name}: {name} must satisfy 1 <= low <= high")
        if self.ttft_slo_factor <= 0 or self.tpot_slo_factor <= 0:
            raise ValueError(f"{self.name}: SLO factors must be > 0")


# Lengths are scaled to the benchmark model's 1024-token context (DistServe keeps prompt + output
# < 2048 with OPT's context): roughly halved from the datasets' typical sizes and clipped so that
# prompt + output always fits.
SHAPES: dict[str, LengthShape] = {
    shape.name: shape
    for shape in (
        LengthShape(
            "chatbot",
            160,
            0.8,
            (16, 640),
            64,
            0.7,
            (8, 256),
            ttft_slo_factor=4.0,
            tpot_slo_factor=3.0,
            source=(
                "ShareGPT conversations (DistServe's chatbot workload): medium prompts, long "
                "and widely spread answers; SLOs as for chatbot OPT-13B (TTFT 0.25 s, TPOT "
                "0.1 s): both a few times the unloaded latency"
            ),
        ),
        LengthShape(
            "code",
            96,
            0.5,
            (16, 320),
            48,
            0.6,
            (8, 192),
            ttft_slo_factor=2.5,
            tpot_slo_factor=5.0,
            source=(
                "HumanEval (DistServe's code-completion workload): a signature and docstring "
                "in, a function body out; tight TTFT (0.125 s), loose TPOT (0.2 s)"
            ),
        ),
        LengthShape(
            "summarization",
            448,
            0.3,
            (192, 896),
            16,
            0.5,
            (4, 64),
            ttft_slo_factor=10.0,
            tpot_slo_factor=2.0,
            source=(
                "LongBench (DistServe's summarization workload): long documents in, short "
                "summaries out; loose TTFT (15 s), tight TPOT (0.15 s), the regime where "
                "a colocated prefill chunk stalls every running decode"
            ),
        ),
    )
}


def unit_rate_gaps(num_requests: int, arrival: str, cv: float, seed: int) -> list[float]:
    """Inter-arrival gaps of a renewal process at rate 1 (mean gap 1 s)."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if cv <= 0:
        raise ValueError(f"the coefficient of variation must be > 0, got {cv}")
    rng = random.Random(seed)
    if arrival == "poisson":
        return [rng.expovariate(1.0) for _ in range(num_requests)]
    shape = 1.0 / (cv * cv)  # gamma(k, θ): mean kθ = 1, cv = 1/sqrt(k)
    return [rng.gammavariate(shape, 1.0 / shape) for _ in range(num_requests)]


def arrival_offsets(unit_gaps: list[float], rate: float) -> list[float]:
    """Arrival times at `rate` requests/s: the first request at 0, then the scaled gaps."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    offsets, now = [], 0.0
    for index, gap in enumerate(unit_gaps):
        if index > 0:
            now += gap / rate
        offsets.append(now)
    return offsets


def _log_normal(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    value = int(round(median * math.exp(rng.gauss(0.0, sigma))))
    return min(max(value, bounds[0]), bounds[1])


def synthetic_lengths(
    shape: LengthShape, num_requests: int, max_model_len: int, seed: int
) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs; the prompt is cut so that the sum fits."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_requests):
        output_len = _log_normal(rng, shape.output_median, shape.output_sigma, shape.output_range)
        prompt_len = _log_normal(rng, shape.prompt_median, shape.prompt_sigma, shape.prompt_range)
        prompt_len = max(1, min(prompt_len, max_model_len - output_len))
        pairs.append((prompt_len, output_len))
    return pairs


@dataclass(frozen=True)
class Mix:
    """A regime of several shapes, each request drawn from one of them and held to that shape's
    SLOs (its class). `interleaved`: each request's shape drawn at random, in equal shares;
    otherwise the shapes follow one another in phases of equal length (the first half of a
    point's requests from the first shape, then the second half from the next)."""

    name: str
    shapes: tuple[str, ...]
    interleaved: bool
    source: str

    def __post_init__(self) -> None:
        unknown = [shape for shape in self.shapes if shape not in SHAPES]
        if len(self.shapes) < 2 or unknown:
            raise ValueError(f"{self.name}: needs two or more of {list(SHAPES)}, got {self.shapes}")

    def classes(self, num_requests: int, seed: int) -> list[str]:
        """The shape of each of `num_requests` requests, in sending order."""
        if self.interleaved:
            rng = random.Random(seed + 7)
            return [rng.choice(self.shapes) for _ in range(num_requests)]
        return [
            self.shapes[index * len(self.shapes) // num_requests] for index in range(num_requests)
        ]

    def point_indices(self, available: int, num: int) -> list[int]:
        """Which of a workload of `available` requests (laid out by `classes(available)`) a
        point of `num` sends, in order: the first `num`, or in phases the first of each phase,
        so that a short point shifts halfway through as a long one does."""
        if self.interleaved or num >= available:
            return list(range(min(num, available)))
        layout, wanted = self.classes(available, 0), self.classes(num, 0)
        return [
            index
            for shape in self.shapes
            for index in [i for i, c in enumerate(layout) if c == shape][: wanted.count(shape)]
        ]


MIXES: dict[str, Mix] = {
    mix.name: mix
    for mix in (
        Mix(
            "mixed",
            ("chatbot", "code", "summarization"),
            interleaved=True,
            source="chatbot, code and summarization requests interleaved at random, each held "
            "to its own shape's SLOs",
        ),
        Mix(
            "shift",
            ("summarization", "chatbot"),
            interleaved=False,
            source="summarization for the first half of each rate's requests, then chatbot: the "
            "traffic moves from long prompts to long outputs",
        ),
    )
}
