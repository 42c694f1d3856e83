"""What travels on one channel for one transfer, and how it leaves and lands in the KV cache.

Per (transfer, channel), in tag order:

    header   int64[6]  MAGIC, transfer_id, status, num_blocks, num_heads, num_payload_messages
    payload  whole:     1 message   [num_layers, 2, num_blocks, block_size, num_heads, head_dim]
             layerwise: 2L messages [num_blocks, block_size, num_heads, head_dim], (layer, k/v) order
    trailer  int64[6]  MAGIC, transfer_id, status, first_token_id, num_tokens, 0

The receiver posts payload receives only after the header arrives, so a sender that cancels before
sending sends a header with status CANCELLED and nothing else; one that cancels later sends the
rest of the payload and a CANCELLED trailer. Either way both sides finish the protocol at once.

Copies. KV cache layout is [num_layers, 2, num_blocks, block_size, heads, head_dim], so one
(layer, k/v) run of consecutive blocks with all heads is contiguous: layerwise messages are sent
from it and received into it without a copy. Otherwise the sender gathers (index_select) and the
receiver stages the message and scatters it (index_copy_).
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
        if key is None:  # [L, 2, n, block_size, heads, head_dim]
            source, dim = self.cache.data[..., self.heads, :], 2
        else:  # [n, block_size, heads, head_dim]
            layer, kv = key
            source, dim = self.cache.data[layer, kv][..., self.heads, :], 0
        torch.index_select(source, dim, self._index(), out=out)
        return out, True

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
        key = self.payload_key(index)
        if key is None:
            self.cache.data[..., self.heads, :].index_copy_(2, self._index(), staged)
        else:
            layer, kv = key
            self.cache.data[layer, kv][..., self.heads, :].index_copy_(0, self._index(), staged)

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
