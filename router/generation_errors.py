"""How a generation fails, in words the servicer maps to gRPC status codes."""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    OVERLOADED = "overloaded"  # RESOURCE_EXHAUSTED
    UNAVAILABLE = "unavailable"  # UNAVAILABLE
    WORKER_ERROR = "worker_error"  # INTERNAL
    DEADLINE = "deadline"  # DEADLINE_EXCEEDED: the client's deadline passed while it waited


class GenerationFailed(Exception):
    """`lost_instance`: the instance whose loss ended the placement, when one did (the request
    may then be placed again elsewhere: router/recovery.py)."""

    def __init__(self, kind: FailureKind, message: str, lost_instance: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.lost_instance = lost_instance
