"""Messages that cross the worker boundary (router <-> prefill, decode and colocated workers).

They live at the bottom of the import graph so that the router and the workers can both use them
without importing each other: the router (router/worker_api.py) re-exports them next to the handle
interfaces it needs, and the workers produce them. Plain, picklable dataclasses; protobuf
conversion happens once, in the router.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.outputs import SchedulerStats
from engine.sampling_params import SamplingParams


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Overloaded(Exception):
    """A worker refused work because it is full (the router answers RESOURCE_EXHAUSTED)."""


class WorkerUnavailable(Exception):
    """A worker died or does not answer (the router answers UNAVAILABLE or retries elsewhere)."""


@dataclass(frozen=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.time() when the router accepted the request
    prefill_instance: str = ""
    decode_instance: str = ""


@dataclass
class RequestTimings:
    """Seconds, measured by the workers; the router adds its own queue time."""

    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    decode_s: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None  # what went wrong, when finish_reason == "error"
    source: str = ""  # instance id that produced these tokens
    timings: RequestTimings | None = None  # on the first token event and on the last
    # On an error: the other instance whose failure ended the request (the decode side of a KV
    # hand-off that broke), so the router can answer UNAVAILABLE, retryable, instead of INTERNAL.
    failed_peer: str = ""


@dataclass
class InstanceLoad:
    instance_id: str
    role: Role
    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0  # prompt tokens queued, not yet prefilled
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    healthy: bool = True
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_stats(
        cls, instance_id: str, role: Role, stats: SchedulerStats, healthy: bool,
        num_other_waiting: int = 0, **extra: float,
    ) -> InstanceLoad:
        """A worker's load from its scheduler's counters; `extra` adds worker-specific ones."""
        return cls(
            instance_id,
            role,
            num_waiting_requests=stats.num_waiting + num_other_waiting,
            num_waiting_tokens=stats.num_queued_prompt_tokens,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            prefix_cache_hit_rate=stats.prefix_hit_rate,
            num_preemptions=stats.num_preemptions,
            healthy=healthy,
            extra={
                "num_prefix_hit_tokens": float(stats.num_prefix_hit_tokens),
                "num_prefix_queried_tokens": float(stats.num_prefix_queried_tokens),
                **{name: float(value) for name, value in extra.items()},
            },
        )
