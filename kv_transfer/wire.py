"""What travels on one channel for one transfer, and how it leaves and lands in the KV cache.

Two wire modes (the ticket says which; see KVTransferConfig for how it is chosen):

    whole (packed): the header, then ONE message built at finish():
        uint8[ header int64[6] | payload [L, 2, heads, num_blocks, block_size, head_dim] | trailer ]
    layerwise: header, then 2 * L * heads * pieces payload messages [piece_blocks, block_size,
        head_dim] in (layer, k/v, head, piece) order, each layer's posted as soon as it is
        computed, then the trailer. The pieces are the runs of the decode side's block ids (the
        ticket's, so both sides know them before anything is sent), up to MAX_PIECES of them.
        Grouped: 2 * L messages [heads, num_blocks, block_size, head_dim] instead.

    header   int64[6]  MAGIC, transfer_id, status, num_blocks, num_heads, num_payload_messages
    trailer  int64[6]  MAGIC, transfer_id, status, first_token_id, num_tokens, sent_at_us
                       (sent_at_us: the sender's wall clock, in microseconds, when it finished
                       the prompt: the first token's time, which the decode side's TPOT counts
                       from)

Each channel carries one transfer after another (streams.py): the receiver posts a transfer's
receives once its header has arrived. A sender that cancels mid-way still sends the rest of the
payload, with a CANCELLED trailer; one that never started sends only a CANCELLED header. Either
way the stream stays in step.

Copies. The KV cache is head-major, [num_layers, 2, heads, num_blocks, block_size, head_dim]
(engine/kv_cache.py), so one (layer, k/v, head) over a run of blocks is one contiguous region:
layerwise messages leave from it and land in it without a copy. The decode side receives in
place when its reservation spans at most MAX_PIECES runs; the prefill side gathers a piece that
is not a run into a staging buffer; past MAX_PIECES, in whole mode, or when per-head messages
would be under `min_piece_bytes`, both sides gather and scatter (docs/design/kv-handoff.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from engine.kv_cache import KVCache
from kv_transfer.config import MAX_MESSAGES_PER_TRANSFER
from kv_transfer.errors import KVTransferError
from kv_transfer.messages import KVTicket
from kv_transfer.staging import StagingPool

MAGIC = 0x4B5654  # "KVT"
HEADER_TAG = 0  # every header: the receiving side cannot know which transfer comes next
STATUS_OK = 0
STATUS_CANCELLED = 1
CONTROL_LEN = 6
_CONTROL_BYTES = CONTROL_LEN * 8
MAX_PIECES = 8


def contiguous_start(block_ids: Sequence[int]) -> int | None:
    """The first id if `block_ids` is a run of consecutive ids, else None."""
    first = block_ids[0]
    if all(block_id == first + i for i, block_id in enumerate(block_ids)):
        return first
    return None


def run_lengths(block_ids: Sequence[int]) -> tuple[int, ...]:
    """The lengths of the runs of consecutive ids in `block_ids`, in order."""
    lengths, start = [], 0
    for i in range(1, len(block_ids)):
        if block_ids[i] != block_ids[i - 1] + 1:
            lengths.append(i - start)
            start = i
    lengths.append(len(block_ids) - start)
    return tuple(lengths)


def int64_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`. On CUDA through pinned memory and a non-blocking
    copy: a copy from pageable memory waits for all the GPU work queued before it (a whole model
    step, when a send thread builds an index while the loop steps)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # the allocator holds the pinned copy


def control_message(values: Sequence[int], device: torch.device) -> torch.Tensor:
    assert len(values) == CONTROL_LEN - 1
    return int64_tensor([MAGIC, *values], device)


def empty_control(device: torch.device) -> torch.Tensor:
    return torch.zeros(CONTROL_LEN, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class WireView:
    """One side's view of one channel's transfer: its cache, block ids and head slice.

    An 8-bit cache (engine/kv_quant.py) travels as uint8: each (layer, k/v, head, block) is one
    region of its values and its scale (KVCacheSpec.block_shape), so every mode and every
    re-sharding by heads carries the scales with their blocks and heads."""

    cache: KVCache
    block_ids: tuple[int, ...]
    heads: slice  # the local heads that travel on this channel
    layerwise: bool
    pieces: tuple[int, ...] | None = None  # layerwise: blocks per piece; None: one piece
    grouped: bool = False  # layerwise: one message per (layer, k/v) with all heads, not per head
    # the ticket's kv_cache_dtype, checked against the cache before any KV moves (None: unchecked;
    # a CANCELLED header carries no KV, so it goes whatever the two sides store)
    kv_cache_dtype: str | None = None

    @classmethod
    def for_ticket(
        cls, cache: KVCache, block_ids: Sequence[int], heads: slice, ticket: KVTicket
    ) -> WireView:
        """One side's view of a ticket's transfer; both sides compute the same from the ticket.
        Layerwise: one message per (layer, k/v, head), each a contiguous region of a block run,
        split into the runs of the decode side's ids (the ticket's) when there are at most
        MAX_PIECES of them; messages of fewer than `ticket.min_piece_bytes` are not worth
        their fixed cost, so pieces that small are not split off, and when even one message
        per head over the whole request would be that small (or would overflow the tag
        window: many layers times many heads), the heads of a (layer, k/v) go as one message,
        gathered and scattered."""
        ids = tuple(block_ids)
        dtype = ticket.kv_cache_dtype
        if not ticket.layerwise:
            return cls(cache, ids, heads, False, kv_cache_dtype=dtype)
        spec = cache.spec
        head_bytes = spec.head_block_bytes  # one head, one block (its scale with it)
        num_heads = heads.stop - heads.start
        per_head = 2 * spec.num_layers * num_heads  # messages per piece
        if num_heads > 1 and (
            len(ids) * head_bytes < ticket.min_piece_bytes
            or per_head + 2 > MAX_MESSAGES_PER_TRANSFER
        ):
            return cls(cache, ids, heads, True, grouped=True, kv_cache_dtype=dtype)
        pieces = run_lengths(ticket.block_ids)
        if (
            1 < len(pieces) <= MAX_PIECES
            and min(pieces) * head_bytes >= ticket.min_piece_bytes
            and per_head * len(pieces) + 2 <= MAX_MESSAGES_PER_TRANSFER
        ):
            return cls(cache, ids, heads, True, pieces=pieces, kv_cache_dtype=dtype)
        return cls(cache, ids, heads, True, kv_cache_dtype=dtype)

    def __post_init__(self) -> None:
        if self.pieces is not None and (
            sum(self.pieces) != len(self.block_ids) or min(self.pieces) < 1 or self.grouped
        ):
            raise ValueError(f"pieces {self.pieces} do not split {len(self.block_ids)} blocks")
        if self.num_messages > MAX_MESSAGES_PER_TRANSFER:
            raise ValueError(
                f"{self.cache.spec.num_layers} layers need {self.num_messages} layerwise messages, "
                f"more than the {MAX_MESSAGES_PER_TRANSFER} tags a transfer has; use whole mode"
            )

    @property
    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start

    @property
    def _groups(self) -> int:
        """Head groups per (layer, k/v): one message each."""
        return 1 if self.grouped else self.num_heads

    @cached_property
    def _pieces(self) -> tuple[tuple[int, int | None, torch.Tensor | None], ...]:
        """Per piece: (blocks, first id if they are one run else None, index tensor if not)."""
        out, offset = [], 0
        for size in self.pieces or (len(self.block_ids),):
            ids = self.block_ids[offset : offset + size]
            start = contiguous_start(ids)
            index = None
            if start is None:
                index = int64_tensor(ids, self.cache.device)
            out.append((size, start, index))
            offset += size
        return tuple(out)

    @property
    def messages_per_layer(self) -> int:
        """Layerwise payload messages per layer: keys then values, per head group, per piece."""
        return 2 * self._groups * len(self._pieces)

    @property
    def num_payload_messages(self) -> int:
        return self.cache.spec.num_layers * self.messages_per_layer if self.layerwise else 1

    @property
    def num_messages(self) -> int:
        return self.num_payload_messages + 2

    def tag(self, transfer_id: int, index: int) -> int:
        """Message `index` (0 the header, 1.. the rest in order). Nothing depends on tags (NCCL
        has none; see streams.py): on gloo they only add a check that the sides agree."""
        if index == 0:
            return HEADER_TAG
        window = (2**31 - 1) // MAX_MESSAGES_PER_TRANSFER
        return (transfer_id % window) * MAX_MESSAGES_PER_TRANSFER + index

    def payload_key(self, index: int) -> tuple[int, int, int, int] | None:
        """(layer, 0 key / 1 value, head group, piece) of payload message `index`, or None for
        the whole request. Group g is local head heads.start + g, or all heads when grouped."""
        if not self.layerwise:
            return None
        num_pieces = len(self._pieces)
        layer, rest = divmod(index, self.messages_per_layer)
        kv, rest = divmod(rest, self._groups * num_pieces)
        group, piece = divmod(rest, num_pieces)
        return layer, kv, group, piece

    @property
    def payload_bytes(self) -> int:
        """The KV bytes this view moves (all payload messages together)."""
        return self.cache.spec.storage_dtype.itemsize * _numel(self._message_shape(None))

    def _message_shape(self, key: tuple[int, int, int, int] | None) -> tuple[int, ...]:
        spec = self.cache.spec
        if key is None:
            shape = (len(self.block_ids), *spec.block_shape)
            return (spec.num_layers, 2, self.num_heads, *shape)
        shape = (self._pieces[key[3]][0], *spec.block_shape)
        return (self.num_heads, *shape) if self.grouped else shape

    def _slab(
        self, key: tuple[int, int, int, int] | None
    ) -> tuple[torch.Tensor, int, tuple[int, int | None, torch.Tensor | None]]:
        """The cache memory payload `key` reads or writes, the dimension of its blocks, and
        its piece."""
        if key is None:  # [L, 2, heads, blocks, block_size, head_dim]; one piece (whole mode)
            return self.cache.data[:, :, self.heads], 3, self._pieces[0]
        layer, kv, group, piece = key
        if self.grouped:  # [heads, blocks, block_size, head_dim]
            return self.cache.data[layer, kv, self.heads], 1, self._pieces[piece]
        head = self.heads.start + group  # [blocks, block_size, head_dim]
        return self.cache.data[layer, kv, head], 0, self._pieces[piece]

    def _run(self, key: tuple[int, int, int, int] | None) -> torch.Tensor | None:
        """The piece's blocks in the cache when they are one run of ids, else None (a
        strided view unless it is one head's: see `_direct`)."""
        slab, dim, (size, start, _) = self._slab(key)
        return None if start is None else slab.narrow(dim, start, size)

    def _direct(self, key: tuple[int, int, int, int] | None) -> torch.Tensor | None:
        """The message's memory in the cache when it is one contiguous region, else None."""
        if key is None or (self.grouped and self.num_heads > 1):
            return None
        return self._run(key)

    def outgoing(self, index: int, staging: StagingPool) -> tuple[torch.Tensor, bool]:
        """Payload message `index` ready to send, and whether it is a staging buffer (to give
        back once sent) rather than a view of the cache."""
        self.check_kv_cache_dtype()
        key = self.payload_key(index)
        direct = self._direct(key)
        if direct is not None:  # one (layer, k/v, head) of a block run: contiguous
            return direct, False
        spec = self.cache.spec
        out = staging.take(self._message_shape(key), spec.storage_dtype, self.cache.device)
        self._gather(key, out)
        return out, True

    def _gather(self, key: tuple[int, int, int, int] | None, out: torch.Tensor) -> None:
        """Copy this view's blocks and heads into `out` (the inverse of `_scatter`)."""
        run = self._run(key)
        if run is not None:  # a run of blocks: a strided copy_
            out.copy_(run)
            return
        source, dim, (_, _, index) = self._slab(key)
        assert index is not None  # a piece that is not a run has its index
        torch.index_select(source, dim, index, out=out)

    def incoming(self, index: int, staging: StagingPool) -> tuple[torch.Tensor, bool]:
        """A buffer to receive payload message `index` into, and whether it is a staging buffer
        (to scatter, then give back) rather than the destination itself."""
        self.check_kv_cache_dtype()
        key = self.payload_key(index)
        direct = self._direct(key)
        if direct is not None:
            return direct, False
        spec = self.cache.spec
        return staging.take(self._message_shape(key), spec.storage_dtype, self.cache.device), True

    def scatter(self, index: int, staged: torch.Tensor) -> None:
        """Write a staged payload message into its blocks and heads."""
        self._scatter(self.payload_key(index), staged)

    def _scatter(self, key: tuple[int, int, int, int] | None, staged: torch.Tensor) -> None:
        run = self._run(key)
        if run is not None:
            run.copy_(staged)
            return
        target, dim, (_, _, index) = self._slab(key)
        assert index is not None
        target.index_copy_(dim, index, staged)

    def check_kv_cache_dtype(self) -> None:
        """Raise unless this side's cache stores KV as the ticket (the decode side) says: the
        bytes of an int8, an fp8 and a full-width cache mean different things."""
        mine = self.cache.spec.kv_dtype
        if self.kv_cache_dtype is not None and self.kv_cache_dtype != mine:
            raise KVTransferError(
                f"kv_cache dtype mismatch: the ticket (the decode instance) stores KV as "
                f"{self.kv_cache_dtype!r} and this rank's cache as {mine!r}; set the same "
                "kv_cache.dtype on prefill and decode"
            )

    def header(self, transfer_id: int, status: int) -> torch.Tensor:
        values = (
            transfer_id,
            status,
            len(self.block_ids),
            self.num_heads,
            self.num_payload_messages,
        )
        # A control message: on the CPU, over gloo, even where the KV goes over NCCL (Channel).
        return control_message(values, torch.device("cpu"))

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
        payload = message[_CONTROL_BYTES : _CONTROL_BYTES + payload_bytes].view(spec.storage_dtype)
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
        sent_at_us: int = 0,
    ) -> torch.Tensor:
        """The one message of a whole-mode transfer (no KV is read when status is CANCELLED)."""
        message = self.packed_buffer(staging)
        header, payload, trailer = self._packed_parts(message)
        header.copy_(self.header(transfer_id, status))
        if status == STATUS_OK:
            self.check_kv_cache_dtype()
            self._gather(None, payload)
        values = (transfer_id, status, first_token_id, num_tokens, sent_at_us)
        trailer.copy_(control_message(values, self.cache.device))
        return message

    def unpack(self, message: torch.Tensor, transfer_id: int, what: str) -> tuple[int, Trailer]:
        """Check a received packed message and scatter its KV (unless cancelled).
        Returns (status, trailer)."""
        header, payload, trailer = self._packed_parts(message)
        status = self.check_header(header, transfer_id, what)
        magic, trailer_tid, _, first_token_id, num_tokens, sent_at_us = trailer.tolist()
        if magic != MAGIC or trailer_tid != transfer_id:
            raise KVTransferError(f"{what}: bad trailer {trailer.tolist()}")
        if status == STATUS_OK:
            self.check_kv_cache_dtype()
            self._scatter(None, payload)
        return status, Trailer(int(first_token_id), int(num_tokens), int(sent_at_us))


@dataclass(frozen=True)
class Trailer:
    """What a transfer's trailer tells beyond its checks."""

    first_token_id: int  # -1: none (a cancelled transfer)
    num_tokens: int
    sent_at_us: int  # 0: not told (a sender that predates the field)

    @property
    def first_token_at(self) -> float | None:
        """The sender's time.time() when the prompt finished, if it told it."""
        return self.sent_at_us / 1e6 if self.sent_at_us > 0 else None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
