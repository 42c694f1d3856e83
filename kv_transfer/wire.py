"""What travels on one channel for one transfer, and how it leaves and lands in the KV cache.

Two wire modes (the ticket says which; see KVTransferConfig for how it is chosen):

    whole (packed): ONE message per channel, built at finish(), the same count as a raw send:
        uint8[ header int64[6] | payload [L, 2, num_blocks, block_size, heads, head_dim] | trailer ]
    layerwise: header, then 2L payload messages [num_blocks, block_size, heads, head_dim] in
        (layer, k/v) order, each posted as soon as its layer is computed, then the trailer.

    header   int64[6]  MAGIC, transfer_id, status, num_blocks, num_heads, num_payload_messages
    trailer  int64[6]  MAGIC, transfer_id, status, first_token_id, num_tokens, 0

The receiver posts every receive at once. A sender that cancels mid-way still sends the rest of
the payload, with a CANCELLED trailer; one that never started (layerwise) sends only a CANCELLED
header, and the receiver then drops the channel (its other receives could never complete).

Copies. KV cache layout is [num_layers, 2, num_blocks, block_size, heads, head_dim], so one
(layer, k/v) run of consecutive blocks with all heads is contiguous: layerwise messages are sent
from it and received into it without a copy. Otherwise the sender gathers (index_select) into a
reused staging buffer and the receiver stages the message and scatters it (index_copy_).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from kv_transfer.config import MAX_MESSAGES_PER_TRANSFER
from kv_transfer.errors import KVTransferError
from kv_transfer.staging import StagingPool

MAGIC = 0x4B5654  # "KVT"
STATUS_OK = 0
STATUS_CANCELLED = 1
CONTROL_LEN = 6
_CONTROL_BYTES = CONTROL_LEN * 8


def contiguous_start(block_ids: Sequence[int]) -> int | None:
    """The first id if `block_ids` is a run of consecutive ids, else None."""
    first = block_ids[0]
    if all(block_id == first + i for i, block_id in enumerate(block_ids)):
        return first
    return None


def control_message(values: Sequence[int], device: torch.device) -> torch.Tensor:
    assert len(values) == CONTROL_LEN - 1
    return torch.tensor([MAGIC, *values], dtype=torch.int64, device=device)


def empty_control(device: torch.device) -> torch.Tensor:
    return torch.zeros(CONTROL_LEN, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class WireView:
    """One side's view of one channel's transfer: its cache, block ids and head slice."""

    cache: KVCache
    block_ids: tuple[int, ...]
    heads: slice  # the local heads that travel on this channel
    layerwise: bool

    def __post_init__(self) -> None:
        if self.num_messages > MAX_MESSAGES_PER_TRANSFER:
            raise ValueError(
                f"{self.cache.spec.num_layers} layers need {self.num_messages} layerwise messages, "
                f"more than the {MAX_MESSAGES_PER_TRANSFER} tags a transfer has; use whole mode"
            )

    @property
    def num_payload_messages(self) -> int:
        return 2 * self.cache.spec.num_layers if self.layerwise else 1

    @property
    def num_messages(self) -> int:
        return self.num_payload_messages + 2

    def tag(self, transfer_id: int, index: int) -> int:
        """Tags are unique per transfer (mod 2^31), so stray messages never match another one."""
        window = (2**31 - 1) // MAX_MESSAGES_PER_TRANSFER
        return (transfer_id % window) * MAX_MESSAGES_PER_TRANSFER + index

    def payload_key(self, index: int) -> tuple[int, int] | None:
        """(layer, 0 key / 1 value) of payload message `index`, or None for the whole request."""
        return divmod(index, 2) if self.layerwise else None

    def _index(self) -> torch.Tensor:
        return torch.tensor(self.block_ids, dtype=torch.long, device=self.cache.device)

    def _direct_view(self, key: tuple[int, int] | None) -> torch.Tensor | None:
        """The cache slice itself when it is one contiguous region, else None."""
        all_heads = self.heads == slice(0, self.cache.spec.num_kv_heads)
        start = contiguous_start(self.block_ids)
        if key is None or not all_heads or start is None:
            return None
        layer, kv = key
        return self.cache.data[layer, kv, start : start + len(self.block_ids)]

    @property
    def payload_bytes(self) -> int:
        """The KV bytes this view moves (all payload messages together)."""
        return self.cache.spec.dtype.itemsize * _numel(self._message_shape(None))

    def _message_shape(self, key: tuple[int, int] | None) -> tuple[int, ...]:
        spec = self.cache.spec
        num_heads = self.heads.stop - self.heads.start
        shape: tuple[int, ...] = (len(self.block_ids), spec.block_size, num_heads, spec.head_dim)
        return shape if key is not None else (spec.num_layers, 2, *shape)

    def outgoing(self, index: int, staging: StagingPool) -> tuple[torch.Tensor, bool]:
        """Payload message `index` ready to send, and whether it is a staging buffer (to give
        back once sent) rather than a view of the cache."""
        key = self.payload_key(index)
        direct = self._direct_view(key)
        if direct is not None:
            return direct, False
        spec = self.cache.spec
        out = staging.take(self._message_shape(key), spec.dtype, self.cache.device)
        self._gather(key, out)
        return out, True

    def _slab(self, key: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
        """This view's heads of the cache for payload `key`, and the dimension of its blocks."""
        if key is None:  # [L, 2, blocks, block_size, heads, head_dim]
            return self.cache.data[..., self.heads, :], 2
        layer, kv = key  # [blocks, block_size, heads, head_dim]
        return self.cache.data[layer, kv][..., self.heads, :], 0

    def _gather(self, key: tuple[int, int] | None, out: torch.Tensor) -> None:
        """Copy this view's blocks and heads into `out` (the inverse of `_scatter`)."""
        source, dim = self._slab(key)
        start = contiguous_start(self.block_ids)
        if start is not None:  # a head slice of a run: a strided copy_ is ~3x index_select's speed
            out.copy_(source.narrow(dim, start, len(self.block_ids)))
        else:
            torch.index_select(source, dim, self._index(), out=out)

    def incoming(self, index: int, staging: StagingPool) -> tuple[torch.Tensor, bool]:
        """A buffer to receive payload message `index` into, and whether it is a staging buffer
        (to scatter, then give back) rather than the destination itself."""
        key = self.payload_key(index)
        direct = self._direct_view(key)
        if direct is not None:
            return direct, False
        spec = self.cache.spec
        return staging.take(self._message_shape(key), spec.dtype, self.cache.device), True

    def scatter(self, index: int, staged: torch.Tensor) -> None:
        """Write a staged payload message into its blocks and heads."""
        self._scatter(self.payload_key(index), staged)

    def _scatter(self, key: tuple[int, int] | None, staged: torch.Tensor) -> None:
        target, dim = self._slab(key)
        start = contiguous_start(self.block_ids)
        if start is not None:  # a strided copy_ is ~9x faster than index_copy_ into a head slice
            target.narrow(dim, start, len(self.block_ids)).copy_(staged)
        else:
            target.index_copy_(dim, self._index(), staged)

    def header(self, transfer_id: int, status: int) -> torch.Tensor:
        num_heads = self.heads.stop - self.heads.start
        values = (transfer_id, status, len(self.block_ids), num_heads, self.num_payload_messages)
        return control_message(values, self.cache.device)

    def check_header(self, header: torch.Tensor, transfer_id: int, what: str) -> int:
        """The sender's status; raises if the two sides disagree on the transfer's shape."""
        expected = self.header(transfer_id, STATUS_OK).tolist()
        got = header.tolist()
        if got[0] != MAGIC or got[1] != transfer_id or got[3:] != expected[3:]:
            raise KVTransferError(
                f"{what}: the sender's header {got} does not match this side's {expected} "
                "(magic, transfer id, status, blocks, heads, messages): the two sides disagree"
            )
        return int(got[2])

    # ------------------------------------------------------------ packed (whole) mode
    def _packed_layout(self) -> tuple[int, int]:
        """(payload bytes, trailer offset) of the packed message; the trailer is 8-aligned."""
        payload_bytes = self.payload_bytes
        return payload_bytes, _CONTROL_BYTES + -(-payload_bytes // 8) * 8

    def _packed_parts(self, message: torch.Tensor) -> tuple[torch.Tensor, ...]:
        payload_bytes, trailer_at = self._packed_layout()
        spec = self.cache.spec
        header = message[:_CONTROL_BYTES].view(torch.int64)
        payload = message[_CONTROL_BYTES : _CONTROL_BYTES + payload_bytes].view(spec.dtype)
        trailer = message[trailer_at : trailer_at + _CONTROL_BYTES].view(torch.int64)
        return header, payload.view(self._message_shape(None)), trailer

    def packed_buffer(self, staging: StagingPool) -> torch.Tensor:
        _, trailer_at = self._packed_layout()
        return staging.take((trailer_at + _CONTROL_BYTES,), torch.uint8, self.cache.device)

    def pack(
        self,
        staging: StagingPool,
        transfer_id: int,
        status: int,
        first_token_id: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """The one message of a whole-mode transfer (no KV is read when status is CANCELLED)."""
        message = self.packed_buffer(staging)
        header, payload, trailer = self._packed_parts(message)
        header.copy_(self.header(transfer_id, status))
        if status == STATUS_OK:
            self._gather(None, payload)
        values = (transfer_id, status, first_token_id, num_tokens, 0)
        trailer.copy_(control_message(values, self.cache.device))
        return message

    def unpack(self, message: torch.Tensor, transfer_id: int, what: str) -> tuple[int, int, int]:
        """Check a received packed message and scatter its KV (unless cancelled).
        Returns (status, first_token_id, num_tokens)."""
        header, payload, trailer = self._packed_parts(message)
        status = self.check_header(header, transfer_id, what)
        magic, trailer_tid, _, first_token_id, num_tokens, _ = trailer.tolist()
        if magic != MAGIC or trailer_tid != transfer_id:
            raise KVTransferError(f"{what}: bad trailer {trailer.tolist()}")
        if status == STATUS_OK:
            self._scatter(None, payload)
        return status, int(first_token_id), int(num_tokens)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
