"""DistServe's metrics, computed from per-request timings (REFERENCES.md, "DistServe"):

    TTFT        = first token time - send time
    TPOT        = (last token time - first token time) / (output tokens - 1), 0 for one token
    ITL         = the gaps between consecutive tokens as the client received them
    e2e         = last token time - send time
    attainment  = share of requests with TTFT <= s * TTFT_SLO and TPOT <= s * TPOT_SLO
                  (a request that failed, or produced no token, meets neither)
    goodput     = the largest rate per device with attainment >= 90%, interpolated linearly
                  between the two measured rates where the curve first crosses 90% going up

Times are wall-clock seconds (time.time() frame); send and token times of one request come from
the same process's monotonic clock, so latencies never mix two machines' clocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ATTAINMENT_TARGET = 0.9
PERCENTILES = (50, 90, 99)
BREAKDOWN_STAGES = (
    "router_queue",
    "prefill_queue",
    "prefill",
    "transfer",
    "decode_queue",
    "decode",
)


@dataclass
class RequestRecord:
    """What the driver saw of one request (one entry of the raw JSON)."""

    request_id: str
    prompt_len: int
    output_len: int  # the target (max_tokens with ignore_eos)
    send_time: float
    token_times: list[float] = field(default_factory=list)  # one per token received
    finish_reason: str = ""
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # the response's Timings
    shard: int = 0
    slo_class: str = ""  # whose SLOs it is held to (SLOs.of); "" in a regime of one shape
    # From the last response: where the request ran (the prefill instance serves a colocated
    # request whole; decode_instance is "" then) and, from an adaptive cluster, how the router
    # placed it: "local" (prefill and decode on one instance) or "remote" (KV moved); "" from a
    # fixed layout. The predictions are the router's for that placement; prefill_role_instances
    # is how many instances took remote prefills when it decided.
    prefill_instance: str = ""
    decode_instance: str = ""
    placement_kind: str = ""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    prefill_role_instances: int | None = None

    @property
    def ok(self) -> bool:
        return not self.error and len(self.token_times) > 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


def ttft(record: RequestRecord) -> float:
    return record.token_times[0] - record.send_time


def tpot(record: RequestRecord) -> float:
    num_tokens = len(record.token_times)
    if num_tokens <= 1:
        return 0.0
    return (record.token_times[-1] - record.token_times[0]) / (num_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    times = record.token_times
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def e2e(record: RequestRecord) -> float:
    return record.token_times[-1] - record.send_time


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def latency_stats(records: Iterable[RequestRecord]) -> dict[str, dict[str, float]]:
    """Mean and p50/p90/p99 of TTFT, TPOT, ITL and e2e over the requests that succeeded."""
    done = [r for r in records if r.ok]
    series = {
        "ttft_s": [ttft(r) for r in done],
        "tpot_s": [tpot(r) for r in done],
        "itl_s": [gap for r in done for gap in inter_token_latencies(r)],
        "e2e_s": [e2e(r) for r in done],
    }
    stats = {}
    for name, values in series.items():
        entry = {f"p{q}": percentile(values, q) for q in PERCENTILES}
        entry["mean"] = sum(values) / len(values) if values else math.nan
        stats[name] = entry
    return stats


@dataclass(frozen=True)
class SLOs:
    """Each request's (TTFT, TPOT) SLOs in seconds, by its class (RequestRecord.slo_class). A
    regime of one shape has one class, which holds for every request; a mix of shapes
    (planner/traffic.py: MIXES) holds each request to its own shape's."""

    by_class: Mapping[str, tuple[float, float]]

    def __post_init__(self) -> None:
        if not self.by_class:
            raise ValueError("SLOs need at least one class")
        for name, (ttft_s, tpot_s) in self.by_class.items():
            if not (ttft_s > 0 and tpot_s > 0):
                raise ValueError(f"SLO class {name!r}: both SLOs must be > 0 s")

    @classmethod
    def single(cls, ttft_slo_s: float, tpot_slo_s: float) -> SLOs:
        return cls({"": (ttft_slo_s, tpot_slo_s)})

    def of(self, record: RequestRecord) -> tuple[float, float]:
        try:
            return self.of_class(record.slo_class)
        except KeyError:
            raise ValueError(
                f"request {record.request_id} has SLO class {record.slo_class!r}; the SLOs "
                f"know {sorted(self.by_class)}"
            ) from None

    def of_class(self, slo_class: str) -> tuple[float, float]:
        """(TTFT, TPOT) SLOs of a class (KeyError if unknown); a single class holds for all."""
        if len(self.by_class) == 1:
            return next(iter(self.by_class.values()))
        return self.by_class[slo_class]


def meets_slo(record: RequestRecord, slos: SLOs, scale: float = 1.0) -> bool:
    ttft_slo_s, tpot_slo_s = slos.of(record)
    return record.ok and ttft(record) <= scale * ttft_slo_s and tpot(record) <= scale * tpot_slo_s


def attainment(records: Sequence[RequestRecord], slos: SLOs, scale: float = 1.0) -> float:
    """The share of `records` that meet both of their SLOs scaled by `scale`."""
    if not records:
        raise ValueError("attainment of no requests is undefined")
    met = sum(meets_slo(r, slos, scale) for r in records)
    return met / len(records)


@dataclass(frozen=True)
class Goodput:
    """`rate` is per device. `bound` says how to read it: "crossed" (interpolated at the 90%
    crossing), "at_least" (every measured rate met 90%: a lower bound, sweep higher) or
    "below_lowest" (even the lowest rate missed 90%: 0, sweep lower)."""

    rate: float
    bound: str


def goodput(points: Sequence[tuple[float, float]], target: float = ATTAINMENT_TARGET) -> Goodput:
    """Goodput from (rate per device, attainment) points of a sweep, in any order.

    Walking up in rate, the first pair (a >= target, next < target) is the crossing; the rate
    there is interpolated linearly. Later points above the target (noise past saturation) are
    ignored, which keeps the figure conservative.
    """
    if not points:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    ordered = sorted(points)
    if ordered[0][1] < target:
        return Goodput(0.0, "below_lowest")
    for (rate_low, att_low), (rate_high, att_high) in zip(ordered, ordered[1:], strict=False):
        if att_low >= target > att_high:
            fraction = (att_low - target) / (att_low - att_high)
            return Goodput(rate_low + fraction * (rate_high - rate_low), "crossed")
    return Goodput(ordered[-1][0], "at_least")


def goodput_interval(
    points: Sequence[tuple[float, Sequence[bool]]],
    confidence: float = 0.9,
    resamples: int = 1000,
    seed: int = 0,
    target: float = ATTAINMENT_TARGET,
) -> tuple[float, float]:
    """How far a sweep's goodput moves on the luck of its requests: a percentile bootstrap that
    redraws each rate's requests (with replacement; `points` are (rate per device, each
    request met its SLOs)) and recomputes `goodput`. It counts a point's requests as independent
    draws, which they are not quite (they share queues), so the interval is the least noise the
    figure carries. Near a flat stretch of the attainment curve it is wide: there a few
    requests more or less over the SLO move the 90% crossing far."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = random.Random(seed)
    rates = []
    for _ in range(resamples):
        drawn = [
            (rate, sum(rng.choices(met, k=len(met))) / len(met) if met else 0.0)
            for rate, met in points
        ]
        rates.append(goodput(drawn, target).rate)
    tail = (1 - confidence) / 2
    return percentile(rates, 100 * tail), percentile(rates, 100 * (1 - tail))


def breakdown(record: RequestRecord) -> dict[str, float]:
    """Where one request's time went, from the response's Timings and the client's clock.

    router_queue, prefill_queue, prefill, transfer and decode_queue are the response's stages,
    each measured where it happens; decode is the rest of the time after the first token
    (client-measured last - first token, less the transfer and decode queue, which happen after
    the first token has left the prefill side).
    """
    timings = record.timings
    after_first = record.token_times[-1] - record.token_times[0] if record.ok else 0.0
    transfer = timings.get("kv_transfer_s", 0.0)
    decode_queue = timings.get("decode_queue_s", 0.0)
    return {
        "router_queue": timings.get("router_queue_s", 0.0),
        "prefill_queue": timings.get("prefill_queue_s", 0.0),
        "prefill": timings.get("prefill_s", 0.0),
        "transfer": transfer,
        "decode_queue": decode_queue,
        "decode": max(0.0, after_first - transfer - decode_queue),
    }


def mean_breakdown(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Each stage's mean over the requests that succeeded (0 for none)."""
    done = [breakdown(r) for r in records if r.ok]
    return {
        stage: (sum(b[stage] for b in done) / len(done) if done else 0.0)
        for stage in BREAKDOWN_STAGES
    }
