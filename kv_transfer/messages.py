"""The hand-off protocol's messages: plain, picklable, frozen dataclasses.

The control plane (Ray calls, pipes in tests) carries them; kv_transfer never sends them itself.

    prefill instance                 control plane                  decode instance
                      ---------- KVReserveRequest ---------->   reserve blocks
                      <--------- KVTicket | KVRefusal -------
    send KV over the pair channels (data plane) ...........>   receive into the blocks
                      <--------- KVTransferDone ------------   ack (success or failure)
    release blocks
    either side, any time: KVAbort ---------------------------> the other side
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kv_transfer.config import DEFAULT_MIN_PIECE_BYTES

if TYPE_CHECKING:  # the control plane (the router included) need not import torch
    from kv_transfer.channel import ChannelEndpoint


@dataclass(frozen=True)
class KVReserveRequest:
    """Ask a decode instance to reserve blocks for a request's prompt KV."""

    request_id: str
    num_tokens: int  # tokens whose KV will travel (the prompt)
    prefill_instance_id: str
    prefill_tp_size: int

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_tokens must be >= 1")
        if self.prefill_tp_size < 1:
            raise ValueError(f"request {self.request_id}: prefill_tp_size must be >= 1")


@dataclass(frozen=True)
class KVTicket:
    """The decode instance's answer: blocks reserved for the request, and where to send them.

    `decode_endpoints[r]` is decode rank r's channel endpoint. `transfer_id` is unique per decode
    instance; it keys the channel handshake and the wire tags, so a message of one transfer can
    never land in another's blocks. The prefill side counts `timeout_s` from when it starts
    sending; the decode side waits up to `start_timeout_s` + `timeout_s` from the reservation
    for the first message, then `timeout_s` from it for the rest (see KVTransferConfig).
    `min_piece_bytes` is the decode side's KVTransferConfig.min_piece_bytes: both sides split a
    layerwise transfer into pieces by the same rule (kv_transfer.wire.WireView.for_ticket).
    """

    request_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    prefill_instance_id: str
    prefill_tp_size: int
    decode_instance_id: str
    decode_tp_size: int
    decode_endpoints: tuple[ChannelEndpoint, ...]
    layerwise: bool
    timeout_s: float
    start_timeout_s: float = 0.0
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
    transport: str = "network"  # KVTransferConfig.transport of the decode side
    # how the decode side's cache stores KV (EngineConfig.kv_cache_dtype): both sides must match
    kv_cache_dtype: str = "auto"
    # time.time() at which the decode side withdraws the reservation if no header came (0: not
    # told). A sender past it (less a margin for clock skew) fails the transfer without touching
    # the channel: a header the decode side no longer expects would break the channel for every
    # transfer queued on it.
    start_by: float = 0.0

    @property
    def wait_to_start_s(self) -> float:
        """The decode side's bound from the reservation to the first message."""
        return self.start_timeout_s + self.timeout_s

    def pair_key(self, prefill_rank: int, decode_rank: int) -> str:
        return f"{self.prefill_instance_id}.{prefill_rank}>{self.decode_instance_id}.{decode_rank}"


@dataclass(frozen=True)
class KVRefusal:
    """Back-pressure: the decode instance has too few free blocks now; try later or elsewhere."""

    request_id: str
    reason: str
    num_blocks_needed: int
    num_free_blocks: int


@dataclass(frozen=True)
class KVTransferDone:
    """Decode -> prefill: the transfer ended. Only after success=True may the prefill side treat
    the KV as delivered; on either outcome it releases its blocks."""

    request_id: str
    transfer_id: int
    success: bool
    error: str | None = None


@dataclass(frozen=True)
class KVAbort:
    """Either side -> the other: stop this transfer and free what it holds.

    From the decode side it carries the ticket: a prefill instance that never got the request
    (the router cancelled between reserve and submit) still ends the decode ranks' posted
    receives with a CANCELLED header, instead of leaving the reservation to its deadline."""

    request_id: str
    transfer_id: int
    reason: str
    ticket: KVTicket | None = field(default=None, compare=False)
