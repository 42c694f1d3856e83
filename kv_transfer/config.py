"""Settings of the KV hand-off: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

# Each (transfer, channel) uses a window of gloo/NCCL tags: header, 2 per layer, trailer.
MAX_MESSAGES_PER_TRANSFER = 1024


@dataclass(frozen=True)
class KVTransferConfig:
    """How KV travels between a prefill and a decode instance.

    `transfer_timeout_s` bounds one request's whole hand-off, from the ticket to the last byte;
    a peer that dies or stalls turns into `KVTransferTimeout`/`KVTransferError` within it.
    `connect_timeout_s` bounds building a channel (both sides must join).
    `layerwise` sends one message per (layer, key/value) instead of one per request: it lets the
    prefill side send layer i while layer i+1 computes and, with contiguous blocks, avoids every
    copy (see benchmarks/kv_transfer.py for the figures that chose the default).
    """

    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    layerwise: bool = True
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not self.host:
            raise ValueError("host must name the address decode ranks listen on, e.g. 127.0.0.1")
