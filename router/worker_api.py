"""What the router needs from workers, and nothing more.

The router imports neither ray nor the worker packages: `deploy/` adapts Ray actors (and tests
adapt plain processes or in-process engines) to these small async interfaces, which make the
calls of worker/protocol.py (the one module for what crosses a process boundary).

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

from typing import Protocol

from kv_transfer.messages import KVTicket
from worker.protocol import (
    InstanceLoad,
    LoadDetails,
    Overloaded,
    PrefixReport,
    RequestTimings,
    Role,
    TokenEvent,
    WorkerRequest,
    WorkerUnavailable,
)

__all__ = [
    "DecodeHandle",
    "InstanceLoad",
    "KVTicket",
    "LoadDetails",
    "Overloaded",
    "PrefillHandle",
    "PrefixReport",
    "RequestTimings",
    "Role",
    "TokenEvent",
    "WorkerHandle",
    "WorkerRequest",
    "WorkerUnavailable",
]


class WorkerHandle(Protocol):
    """One worker instance, as the router sees it. Every method is bounded by its own timeout."""

    instance_id: str
    role: Role

    async def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad:
        """The instance's load; with `prefix`, its prefix cache's changes or contents too."""
        ...

    async def abort(self, request_id: str) -> None:
        """Free every state the instance holds for the request; a no-op if it holds none."""
        ...

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        """Events gathered since the last poll; waits up to timeout_s for the first one."""
        ...


class DecodeHandle(WorkerHandle, Protocol):
    async def reserve(self, request: WorkerRequest) -> KVTicket:
        """Reserve KV blocks for the request's prompt; returns the ticket for the prefill
        instance, or raises Overloaded."""
        ...


class PrefillHandle(WorkerHandle, Protocol):
    async def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        """Queue the prompt. With a ticket, hand the KV off to the decode instance it names;
        a colocated instance takes ticket=None and decodes itself. Raises Overloaded."""
        ...
