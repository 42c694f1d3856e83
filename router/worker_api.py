"""What the router needs from workers, and nothing more.

The router imports neither ray nor the worker packages: `deploy/` adapts Ray actors (and tests
adapt plain processes or in-process engines) to these small async interfaces. Every message that
crosses the boundary is one of the dataclasses below.

One request, disaggregated:

    router --reserve(req)--> decode handle      (blocks reserved, or Overloaded = back-pressure)
           <--- ticket ----
    router --submit(req, ticket)--> prefill handle
           <== TokenEvent(first token) == prefill handle        (TTFT)
           <== TokenEvent(tokens...) ==== decode handle, one event per step per request (TPOT)

One request, colocated: `submit(req, None)` on a colocated handle; all events come from it.

Events reach the router through `poll_events`, a long poll that returns every event the handle has
gathered (at most one list per worker step), so a Ray actor call carries a whole step at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

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


class WorkerHandle(Protocol):
    """One worker instance, as the router sees it. Every method is bounded by its own timeout."""

    instance_id: str
    role: Role

    async def load(self) -> InstanceLoad: ...

    async def abort(self, request_id: str) -> None:
        """Free every state the instance holds for the request; a no-op if it holds none."""
        ...

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        """Events gathered since the last poll; waits up to timeout_s for the first one."""
        ...


class DecodeHandle(WorkerHandle, Protocol):
    async def reserve(self, request: WorkerRequest) -> object:
        """Reserve KV blocks for the request's prompt; returns an opaque ticket for the prefill
        instance, or raises Overloaded."""
        ...


class PrefillHandle(WorkerHandle, Protocol):
    async def submit(self, request: WorkerRequest, ticket: object | None) -> None:
        """Queue the prompt. With a ticket, hand the KV off to the decode instance it names;
        a colocated instance takes ticket=None and decodes itself. Raises Overloaded."""
        ...
