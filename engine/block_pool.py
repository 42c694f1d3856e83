"""The paged KV block pool: pure Python over integer block ids.

Tensors live in `engine.kv_cache.KVCache`; this module only decides which block ids are in use.

A block is in exactly one of three states:

    in use     ref_cnt > 0                      (not in the free list)
    cached     ref_cnt == 0, has a hash          (in the free list AND in the hash map: evictable)
    free       ref_cnt == 0, no hash             (in the free list only)

The free list is ordered LRU first: `allocate` takes from the head, `free` appends to the tail, so
the prefix cache evicts the blocks that were released longest ago. A cached block that is hit again
(`touch`) leaves the free list until its last user frees it.

Runs. `allocate_run` hands out consecutive ids when the free blocks hold such a run (found by a
search over a one-byte-per-block state map, in C), so a KV hand-off into or out of those blocks
moves each (layer, k/v, head) as one message with no gather or scatter copy (see
kv_transfer/wire.py). It takes a run of uncached blocks if there is one, else a run that evicts
cached blocks out of LRU order (measured by benchmarks/block_runs.py: with the prefix cache on,
nearly every free block is cached in steady state, so insisting on uncached runs found almost
none), else falls back to `allocate`.

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

# allocate_run's state map, one byte per block: in use, free and cached after a hit (only LRU
# evicts it), free and cached without a hit yet (a run may evict it), free.
_IN_USE, _REUSED, _CACHED, _PLAIN = b"\x00", b"\x01", b"\x02", b"\x03"


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it depends on every token before it, not just its own.

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so the same prefix hashes
    the same in every process (the router's KV-aware policy relies on that). Collisions are
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
class PrefixCacheChanges:
    """What a prefix cache stored and evicted since it was last asked, as chained block hashes:
    the events a KV-aware router keeps its index of "which instance holds which prefix" with
    (vLLM's KV events, Dynamo's stored/removed). With `snapshot`, `stored` is every block the
    cache holds, and replaces whatever the reader knew."""

    stored: list[BlockHash]
    removed: list[BlockHash]
    snapshot: bool = False


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens whose KV the block holds, kept for cached blocks so a hash hit is verified.
    token_ids: tuple[int, ...] | None = None
    reused: bool = False  # a prefix-cache hit found it since it was cached: LRU keeps it


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
        # Each block's state as one byte (in use / free and cached / free), for allocate_run's
        # searches for runs of consecutive free ids.
        self._state = bytearray(_PLAIN * num_blocks)
        self.num_cache_evictions = 0
        # Hash -> still cached?, since the last `take_cache_changes`; None until a reader asks
        # (and after an overflow: then the next reader gets a snapshot).
        self._changes: dict[BlockHash, bool] | None = None

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
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self._claim(block_id)
        return block_ids

    def allocate_run(
        self, num_blocks: int, after: int | None = None, max_runs: int = 8
    ) -> list[int]:
        """Like `allocate`, but consecutive ids where the free blocks allow. In order: the blocks
        right after block `after` (a block table growing in place); a run of uncached blocks; a
        run that evicts cached blocks no prefix hit has found yet; for a new table, the longest
        such runs, at most `max_runs` of them (the KV hand-off moves up to 8 runs in place);
        else `allocate`'s LRU choice. Growth (`after` given) takes runs from the top of the id
        space and new tables from the bottom, so sequences' one-block steps do not break up the
        long runs reservations need."""
        if num_blocks <= 0 or num_blocks > len(self._free):
            return self.allocate(num_blocks)
        block_ids = self._run_ids(num_blocks, after, max_runs)
        if not block_ids:
            return self.allocate(num_blocks)
        for block_id in block_ids:
            del self._free[block_id]
            self._claim(block_id)
        return block_ids

    def _run_ids(self, num_blocks: int, after: int | None, max_runs: int) -> list[int]:
        """allocate_run's choice of free ids, or [] for the LRU fallback."""
        state = self._state
        if after is not None:
            following = state[after + 1 : after + 1 + num_blocks]
            if len(following) == num_blocks and not following.translate(None, _EVICTABLE):
                return list(range(after + 1, after + 1 + num_blocks))
        start = (state.rfind if after is not None else state.find)(_PLAIN * num_blocks)
        if start < 0:
            start = _find_run(state, num_blocks, from_top=after is not None)
        if start >= 0:
            return list(range(start, start + num_blocks))
        if after is None and max_runs > 1:
            return _longest_runs(state, num_blocks, max_runs)
        return []

    def _claim(self, block_id: int) -> None:
        """A block just taken off the free list: its cached content goes, and its one reference
        is the caller's."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        self._state[block_id] = _IN_USE[0]

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
                self._state[block_id] = _free_state(block)[0]

    def free_sequence_blocks(self, block_table: Sequence[int]) -> None:
        """Free a sequence's block table, tail first (LRU: its shared prefix stays cached longest)."""
        self.free(reversed(block_table))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit, or another holder of the same block)."""
        for block_id in block_ids:
            block = self._block(block_id)
            if block.ref_cnt == 0:
                del self._free[block_id]
                self._state[block_id] = _IN_USE[0]
            block.ref_cnt += 1

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block caching exactly these tokens under this chained hash, or None."""
        if not self.enable_caching:
            return None
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None  # a hash collision; never reuse KV of other tokens
        if not block.reused:
            block.reused = True
            if block.ref_cnt == 0:
                self._state[block_id] = _REUSED[0]
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
        self._note_change(block_hash, True)

    def take_cache_changes(self, snapshot: bool = False) -> PrefixCacheChanges:
        """The cache's changes since the last call (a snapshot on the first call, when asked,
        and after more changes piled up than twice the pool's blocks: a reader that stopped
        asking costs bounded memory)."""
        changes, self._changes = self._changes, {}
        if snapshot or changes is None:
            return PrefixCacheChanges(list(self._cached), [], snapshot=True)
        stored = [block_hash for block_hash, cached in changes.items() if cached]
        removed = [block_hash for block_hash, cached in changes.items() if not cached]
        return PrefixCacheChanges(stored, removed)

    def _note_change(self, block_hash: BlockHash, cached: bool) -> None:
        changes = self._changes
        if changes is not None:
            changes[block_hash] = cached
            if len(changes) > 2 * self.num_blocks:
                self._changes = None

    def reset_prefix_cache(self) -> None:
        self._changes = None  # the next reader gets a snapshot (an empty one)
        for block_hash, block_id in list(self._cached.items()):
            del self._cached[block_hash]
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = None
            block.reused = False
            if block.ref_cnt == 0:
                self._state[block_id] = _PLAIN[0]

    # --------------------------------------------------------------- internals
    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} is outside the pool of {self.num_blocks}")
        return self.blocks[block_id]

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self._note_change(block.block_hash, False)
        block.block_hash = None
        block.token_ids = None
        block.reused = False
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
            state = _free_state(block) if in_free else _IN_USE
            assert self._state[block.block_id] == state[0], (
                f"block {block.block_id}: the state map says {self._state[block.block_id]}, "
                f"the block is {state[0]}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has a hash the cache map does not point back to"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash


_EVICTABLE = _PLAIN + _CACHED  # what a run may take (bytes.translate deletes these)
_TO_MASK = bytes(int(b in _EVICTABLE) for b in range(256))  # state byte -> 1 if evictable


def _free_state(block: Block) -> bytes:
    if block.block_hash is None:
        return _PLAIN
    return _REUSED if block.reused else _CACHED


def _evictable_mask(state: bytearray) -> bytearray:
    """b"\\x01" where a run may take the block, b"\\x00" elsewhere (one C pass)."""
    return state.translate(_TO_MASK)


def _find_run(state: bytearray, num_blocks: int, from_top: bool) -> int:
    """Start of the lowest (or highest) run of `num_blocks` evictable blocks, or -1. Plain
    substring searches over a 0/1 mask: linear, in C (a regex with a repeat retries from every
    start, quadratic on a fragmented pool)."""
    mask, want = _evictable_mask(state), b"\x01" * num_blocks
    return mask.rfind(want) if from_top else mask.find(want)


# At most this many free runs are examined for a cover (bounds a very fragmented pool's cost).
_MAX_RUNS_EXAMINED = 256


def _longest_runs(state: bytearray, num_blocks: int, max_runs: int) -> list[int]:
    """Ids of evictable blocks covering `num_blocks` in at most `max_runs` runs, or [] if none
    is found: the longest runs of at least num_blocks / max_runs blocks, taken whole, then, if
    blocks are still missing, the lowest run that holds the rest. In id order."""
    mask = bytearray(_evictable_mask(state))
    want = b"\x01" * -(-num_blocks // max_runs)  # a run at least this long (C searches only)
    runs: list[tuple[int, int]] = []  # (length, start)
    position = mask.find(want)
    while position >= 0 and len(runs) < _MAX_RUNS_EXAMINED:
        end = mask.find(b"\x00", position)
        end = len(mask) if end < 0 else end
        runs.append((end - position, position))
        position = mask.find(want, end)
    runs.sort(key=lambda run: -run[0])
    chosen, need = [], num_blocks
    for length, start in runs[: max_runs - 1]:
        take = min(length, need)
        chosen.append((start, take))
        need -= take
        mask[start : start + take] = bytes(take)
        if need == 0:
            break
    if need > 0:  # the last run may be shorter than the others
        start = mask.find(b"\x01" * need)
        if start < 0:
            return []
        chosen.append((start, need))
    return [i for start, take in sorted(chosen) for i in range(start, start + take)]
