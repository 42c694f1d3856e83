"""Settings of the KV hand-off: one frozen dataclass, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Each (transfer, channel) uses a window of gloo/NCCL tags: the header, 2 per layer, head and
# piece, the trailer (80 layers x 8 heads on one channel fit in one piece; a transfer needing
# more pieces than fit is sent in one). The window still spans 524,287 transfer ids.
MAX_MESSAGES_PER_TRANSFER = 4096
DEFAULT_MIN_PIECE_BYTES = 256 * 1024  # KVTransferConfig.min_piece_bytes; tickets carry it
TRANSPORTS = ("auto", "same_node", "network")


@dataclass(frozen=True)
class KVTransferConfig:
    """How KV travels between a prefill and a decode instance.

    Two deadlines bound a hand-off. `start_timeout_s`: how long a decode reservation waits, on
    top of `transfer_timeout_s`, for the prefill side to start sending; it covers the request's
    prefill queue and compute, so a busy prefill instance is late rather than failed. A live
    prefill instance ends a reservation it will not serve at once (a CANCELLED message); one that
    died leaves it to this deadline, because a posted gloo receive cannot be withdrawn: so the
    default stays modest, and a deployment whose prefill queues run longer raises it.
    `transfer_timeout_s`: from the start of the send to the last byte; a peer that dies or stalls
    mid-transfer turns into `KVTransferTimeout`/`KVTransferError` within it. Building a channel is
    part of the start.
    The decode side cannot tell the start of a whole-mode transfer from its end (one message), so
    there the two add up; a prefill side that stalls mid-send still fails at its own deadline
    and aborts.
    `layerwise` picks the wire mode: True sends one message per (layer, key/value), so the
    prefill side can send layer i while layer i+1 computes and contiguous block runs travel with
    no copy; False packs the whole request into one message per channel (fewest round trips).
    None (the default) chooses per request: layerwise from `layerwise_min_tokens` tokens up,
    whole below, as measured by benchmarks/kv_transfer_speed.py (whole wins at 64-512 tokens on
    per-request overhead, layerwise at 2048 and up on throughput).
    `min_piece_bytes`: a layerwise transfer into a reservation of up to 8 runs of block ids is
    sent as one piece per run, each received in place, when every piece's messages carry at
    least this many bytes; below it one message per (layer, k/v, head) and a scatter copy cost
    less (a message's fixed cost is ~40 us each side on loopback gloo here). Tickets carry it.
    `transport`: how the KV moves between a pair of ranks. "same_node": the decode rank copies
    it out of the prefill rank's cache through shared memory (CUDA IPC on GPU), see
    same_node.py; "network": through the pair's process group (NCCL on GPU, gloo on CPU);
    "auto" (the default): same_node when the two ranks run on one node, else network.
    """

    transfer_timeout_s: float = 30.0
    start_timeout_s: float = 60.0
    layerwise: bool | None = None
    layerwise_min_tokens: int = 2048
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
    host: str = "127.0.0.1"
    transport: str = "auto"

    def __post_init__(self) -> None:
        if not (self.transfer_timeout_s > 0 and math.isfinite(self.transfer_timeout_s)):
            raise ValueError(
                f"transfer_timeout_s must be a finite number > 0, got {self.transfer_timeout_s}"
            )
        if not (self.start_timeout_s >= 0 and math.isfinite(self.start_timeout_s)):
            raise ValueError(
                f"start_timeout_s must be a finite number >= 0, got {self.start_timeout_s}"
            )
        if self.min_piece_bytes < 0:
            raise ValueError(f"min_piece_bytes must be >= 0, got {self.min_piece_bytes}")
        if self.layerwise_min_tokens < 1:
            raise ValueError(f"layerwise_min_tokens must be >= 1, got {self.layerwise_min_tokens}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if not self.host:
            raise ValueError("host must name the address decode ranks listen on, e.g. 127.0.0.1")

    def use_layerwise(self, num_tokens: int) -> bool:
        """The wire mode for a request of `num_tokens` prompt tokens."""
        if self.layerwise is not None:
            return self.layerwise
        return num_tokens >= self.layerwise_min_tokens
