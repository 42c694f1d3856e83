"""The paged KV block pool: pure Python over integer block ids.

Tensors live in `engine.kv_cache.KVCache`; this module only decides which block ids are in use.

A block is in exactly one of three states:

    in use     ref_cnt > 0                      (not in the free list)
    cached     ref_cnt == 0, has a hash          (in the free list AND in the hash map: evictable)
    free       ref_cnt == 0, no hash             (in the free list only)

The free list is ordered LRU first: `allocate` takes from the head, `free` appends to the tail, so
the prefix cache evicts the blocks that were released longest ago. A cached block that is hit again
(`touch`) leaves the free list until its last user frees it.

Runs. `allocate_run` hands out consecutive ids when the pool has a run of free, uncached blocks
(found with a substring search over a byte map of them, in C), so a KV hand-off into or out of
those blocks moves each (layer, k/v, head) as one message with no gather or scatter copy (see
kv_transfer/wire.py). It never evicts cached blocks out of LRU order to make a run: without a
run it falls back to `allocate`.

Invariant that the KV hand-off relies on: a block id is handed out by `allocate` only while its
ref_cnt is 0, so any holder (a running sequence, a transfer in flight) keeps the block from reuse
simply by holding a reference. Freeing a block whose ref_cnt is already 0 raises: no double free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", int)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it depends on every token before it, not just its own.

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so the same prefix hashes
    the same in every process (the router's prefix-affinity policy relies on that). Collisions are
    harmless: a hit is only used after its token ids compare equal.
    """
    return BlockHash(hash((parent if parent is not None else -1, tuple(token_ids))))


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens whose KV the block holds, kept for cached blocks so a hash hit is verified.
    token_ids: tuple[int, ...] | None = None


class BlockPoolError(RuntimeError):
    """A caller broke the pool's protocol (double free, freeing an unknown id, over-allocation)."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None; insertion order is LRU order (head = least recently released).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # 1 where a block is free and uncached (what allocate_run may take), else 0
        self._plain = bytearray(b"\x01") * num_blocks
        self.num_cache_evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` may hand out now (free plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free list in LRU order (head first); for tests and debugging."""
        return list(self._free)

    # ------------------------------------------------------------------- verbs
    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the LRU head, evicting cached content they held."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise BlockPoolError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self._plain[block_id] = 0
            block_ids.append(block_id)
        return block_ids

    def allocate_run(self, num_blocks: int, after: int | None = None) -> list[int]:
        """Like `allocate`, but consecutive ids when free, uncached blocks allow: first the ones
        right after block `after` (a block table growing in place), else the lowest such run;
        without one, `allocate`'s LRU choice."""
        if num_blocks <= 0 or num_blocks > len(self._free):
            return self.allocate(num_blocks)
        want = b"\x01" * num_blocks
        start = -1
        if after is not None and self._plain[after + 1 : after + 1 + num_blocks] == want:
            start = after + 1
        if start < 0:
            start = self._plain.find(want)
        if start < 0:
            return self.allocate(num_blocks)
        block_ids = list(range(start, start + num_blocks))
        for block_id in block_ids:
            del self._free[block_id]
            self.blocks[block_id].ref_cnt = 1
        self._plain[start : start + num_blocks] = bytes(num_blocks)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Blocks reaching 0 join the LRU tail in this order.

        Callers free a sequence's blocks tail first (see `free_sequence_blocks`) so that the prefix
        cache evicts a sequence's last blocks before its shared head.
        """
        for block_id in block_ids:
            block = self._block(block_id)
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                self._plain[block_id] = block.block_hash is None

    def free_sequence_blocks(self, block_table: Sequence[int]) -> None:
        """Free a sequence's block table, tail first (LRU: its shared prefix stays cached longest)."""
        self.free(reversed(block_table))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit, or another holder of the same block)."""
        for block_id in block_ids:
            block = self._block(block_id)
            if block.ref_cnt == 0:
                del self._free[block_id]
                self._plain[block_id] = 0
            block.ref_cnt += 1

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block caching exactly these tokens under this chained hash, or None."""
        if not self.enable_caching:
            return None
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self.blocks[block_id].token_ids != tuple(token_ids):
            return None  # a hash collision; never reuse KV of other tokens
        return block_id

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its chained hash (first writer wins)."""
        if not self.enable_caching:
            return
        block = self._block(block_id)
        if block.ref_cnt <= 0:
            raise BlockPoolError(f"cannot cache block {block_id}: it is not in use")
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            del self._cached[block_hash]
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = None
            self._plain[block_id] = block.ref_cnt == 0

    # --------------------------------------------------------------- internals
    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} is outside the pool of {self.num_blocks}")
        return self.blocks[block_id]

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_cache_evictions += 1

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free), "duplicate id in the free list"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_free = block.block_id in free_ids
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free={in_free}"
            )
            plain = in_free and block.block_hash is None
            assert self._plain[block.block_id] == plain, (
                f"block {block.block_id}: run map says {self._plain[block.block_id]}, "
                f"free and uncached is {plain}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has a hash the cache map does not point back to"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
