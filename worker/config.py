"""Settings of one worker instance: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig
from worker.protocol import Role


@dataclass(frozen=True)
class WorkerConfig:
    """What one instance (all its TP ranks) is built with.

    `engine` sets the model, TP size, KV pool, token budget, chunk size and prefix caching.
    `role` is what the router uses the instance for. Its KV connector sides follow from it
    unless given: `sends_kv` (prefill for the decode instance a ticket names: PREFILL) and
    `receives_kv` (reserve and receive a prompt's KV from a prefill instance: DECODE). An
    instance may hold both; a request submitted without a ticket runs both phases here on any
    instance. `kv_transfer` sets the hand-off's deadlines and transport.

    Back-pressure (Overloaded, which the router turns into another instance or
    RESOURCE_EXHAUSTED): `submit` past `max_queued_tokens` prompt tokens or
    `max_waiting_requests` requests waiting; `reserve` when the prompt would leave fewer than
    `watermark_blocks` free blocks for the running sequences' growth (so new arrivals do not
    force preemptions of sequences already decoding).
    """

    engine: EngineConfig
    role: Role = Role.COLOCATED
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    sends_kv: bool | None = None
    receives_kv: bool | None = None
    max_queued_tokens: int = 65536
    max_waiting_requests: int = 256
    watermark_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        for name, minimum in (
            ("max_queued_tokens", 1),
            ("max_waiting_requests", 1),
            ("watermark_blocks", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.sends_kv is None:
            object.__setattr__(self, "sends_kv", self.role in (Role.PREFILL, Role.ADAPTIVE))
        if self.receives_kv is None:
            object.__setattr__(self, "receives_kv", self.role in (Role.DECODE, Role.ADAPTIVE))

    @classmethod
    def prefill(
        cls, engine: EngineConfig, kv_transfer: KVTransferConfig | None = None, **limits: Any
    ) -> WorkerConfig:
        """A prefill instance's config (`limits`: max_queued_tokens, max_waiting_requests)."""
        return replace(cls(engine, Role.PREFILL, kv_transfer or KVTransferConfig()), **limits)

    @classmethod
    def decode(
        cls, engine: EngineConfig, kv_transfer: KVTransferConfig | None = None, **limits: Any
    ) -> WorkerConfig:
        """A decode instance's config (`limits`: watermark_blocks)."""
        return replace(cls(engine, Role.DECODE, kv_transfer or KVTransferConfig()), **limits)

    @classmethod
    def adaptive(
        cls, engine: EngineConfig, kv_transfer: KVTransferConfig | None = None, **limits: Any
    ) -> WorkerConfig:
        """An adaptive instance's config: it prefills for others, decodes what others
        prefilled, and runs requests start to end, as the router places each one. Its engine
        schedules by SLO (engine/slo.py): the router's placer predicts with that gate."""
        engine = replace(engine, slo_scheduling=True)
        return replace(cls(engine, Role.ADAPTIVE, kv_transfer or KVTransferConfig()), **limits)
