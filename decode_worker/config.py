"""Settings of one decode instance: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class DecodeConfig:
    """What a decode instance (all its TP ranks) is built with.

    `engine` sets the model, TP size (default 1), KV pool, `max_num_seqs` and the token budget;
    `kv_transfer` the hand-off. `watermark_blocks` free blocks are kept for the running
    sequences' growth: `reserve` refuses (Overloaded) a prompt that would eat into them, so new
    arrivals do not force preemptions of sequences already decoding.
    """

    engine: EngineConfig
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    watermark_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if not isinstance(self.watermark_blocks, int) or self.watermark_blocks < 0:
            raise ValueError(
                f"watermark_blocks must be an integer >= 0, got {self.watermark_blocks!r}"
            )
