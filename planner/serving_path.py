"""The serving path's terms (`pdserve profile --path`, benchmarks/profiling/path.py) in the model.

An engine step is not all a worker's step costs, and a worker's core is not all its own:
  overhead       each step: the larger of the worker's extra CPU and its extra wall time at
                 batch 1 (the loop's waits); each sequence of a step: its token's way out (gRPC)
  ttft path      the hops to a first token (client -> router -> worker -> back), added to TTFT
  relay share    the router and the client are not pinned: at `rate` req/s they take
                 rate * (request + mean output * token) ms of CPU per second off the instances'
                 cores, so every step there takes 1 / (1 - that share) as long
"""

from __future__ import annotations

from dataclasses import replace

from planner.profile import ModelProfile

MAX_SHARE = 0.95  # past this the cores are the relay's: the run is saturated anyway


def apply_serving_path(profile: ModelProfile) -> ModelProfile:
    """Every TP entry with a measured serving path gets its per-step and per-sequence cost."""
    by_tp = {}
    for tp, entry in profile.by_tp.items():
        path = entry.serving_path
        if path:
            step = max(path.get("worker_step_ms", 0.0), path.get("worker_step_wall_ms", 0.0))
            entry = replace(entry, overhead=(step, 0.0),
                            overhead_per_seq=path.get("worker_seq_ms", 0.0))  # fmt: skip
        by_tp[tp] = entry
    return replace(profile, by_tp=by_tp)


def ttft_path_ms(profile: ModelProfile) -> float:
    return max((e.serving_path.get("path_ttft_ms", 0.0) for e in profile.by_tp.values()),
               default=0.0)  # fmt: skip


def relay_ms(profile: ModelProfile) -> tuple[float, float]:
    """(ms per request, ms per token) of router + client CPU, from the TP=1 entry or the first."""
    entry = profile.by_tp.get(1) or next(iter(profile.by_tp.values()))
    path = entry.serving_path
    return (path.get("relay_request_ms", 0.0), path.get("relay_token_ms", 0.0))


def relay_scale(
    relay: tuple[float, float], rate: float, mean_output: float, num_cores: int
) -> float:
    """How much longer each step takes while the relay shares `num_cores` at `rate` req/s."""
    busy = rate * (relay[0] + mean_output * relay[1]) / 1e3  # cores' worth of CPU
    share = min(busy / num_cores, MAX_SHARE)
    return 1.0 / (1.0 - share)
