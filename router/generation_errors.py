"""How a generation fails, in words the servicer maps to gRPC status codes."""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    OVERLOADED = "overloaded"  # RESOURCE_EXHAUSTED
    UNAVAILABLE = "unavailable"  # UNAVAILABLE
    WORKER_ERROR = "worker_error"  # INTERNAL


class GenerationFailed(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
