"""Settings of one prefill instance: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class PrefillConfig:
    """What a prefill instance (all its TP ranks) is built with.

    `engine` sets the model, TP size, KV pool, token budget (`max_num_batched_tokens`), chunk
    size and prefix caching; `kv_transfer` the hand-off. `max_queued_tokens` bounds the prompt
    tokens waiting for prefill: past it `submit` raises Overloaded (the router's back-pressure).
    """

    engine: EngineConfig
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    max_queued_tokens: int = 65536

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if not isinstance(self.max_queued_tokens, int) or self.max_queued_tokens < 1:
            raise ValueError(
                f"max_queued_tokens must be an integer >= 1, got {self.max_queued_tokens!r}"
            )
