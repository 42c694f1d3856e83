"""Property tests of the block pool: a hypothesis state machine drives allocate / share (touch) /
cache / lookup / free in any order against a plain model of what the pool must hold, including
the exact LRU order of the free list, and checks that no double free gets through."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_pool import (
    BlockHash,
    BlockPool,
    BlockPoolError,
    hash_block_tokens,
    hash_prompt_blocks,
)

# Small hash and token spaces so that hash hits, first-writer-wins and collisions
# (same hash, other tokens) all happen often.
hashes = st.integers(min_value=0, max_value=5).map(BlockHash)
block_tokens = st.tuples(st.integers(0, 2), st.integers(0, 2))


class BlockPoolMachine(RuleBasedStateMachine):
    """Each holder owns one reference to each block id in its list (a sequence, a transfer...)."""

    @initialize(num_blocks=st.integers(1, 16), enable_caching=st.booleans())
    def make_pool(self, num_blocks: int, enable_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.holders: list[list[int]] = []
        self.ref_cnt = [0] * num_blocks
        self.free_list = list(range(num_blocks))  # the model's LRU order, head first
        self.cache: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash -> (block id, tokens)
        self.reused: set[int] = set()  # cached blocks a lookup has hit: only LRU evicts them
        self.reader: set[int] | None = None  # what a reader of the cache's changes knows

    def _cached_hash_of(self, block_id: int) -> int | None:
        return next((h for h, (b, _) in self.cache.items() if b == block_id), None)

    @rule(num_blocks=st.integers(0, 4))
    def allocate(self, num_blocks: int) -> None:
        if num_blocks > len(self.free_list):
            assert not self.pool.can_allocate(num_blocks)
            with pytest.raises(BlockPoolError):
                self.pool.allocate(num_blocks)
            return
        block_ids = self.pool.allocate(num_blocks)
        assert block_ids == self.free_list[:num_blocks]  # taken from the LRU head
        self._take(block_ids)

    @rule(num_blocks=st.integers(1, 10), max_runs=st.sampled_from([2, 3, 8]), data=st.data())
    def allocate_run(self, num_blocks: int, max_runs: int, data: st.DataObject) -> None:
        """Consecutive ids where the free blocks allow: right after `after`; else a run of
        uncached blocks; else a run that evicts cached blocks no hit has found (lowest first for
        a new table, highest first for growth); else, for a new table, the longest such runs (at
        most `max_runs`); else the LRU head like allocate."""
        if num_blocks > len(self.free_list):
            with pytest.raises(BlockPoolError):
                self.pool.allocate_run(num_blocks, max_runs=max_runs)
            return
        size = len(self.ref_cnt)
        after = data.draw(st.none() | st.integers(0, size - 1))
        free, cached = set(self.free_list), {b for b, _ in self.cache.values()}

        def plain(block_id: int) -> bool:
            return block_id in free and block_id not in cached

        def evictable(block_id: int) -> bool:
            return block_id in free and block_id not in self.reused

        def run_at(start: int, fits: Callable[[int], bool]) -> bool:
            return start + num_blocks <= size and all(map(fits, range(start, start + num_blocks)))

        starts = list(range(size - num_blocks + 1))
        if after is not None:
            starts.reverse()  # growth searches from the top
        expected = next(
            (
                list(range(start, start + num_blocks))
                for fits in (plain, evictable)
                for start in starts
                if run_at(start, fits)
            ),
            None,
        )
        if expected is None and after is None:  # a new table: the longest runs, up to 8
            expected = self._longest_runs(num_blocks, evictable, max_runs)
        if expected is None:
            expected = self.free_list[:num_blocks]  # the LRU fallback
        if after is not None and run_at(after + 1, evictable):
            expected = list(range(after + 1, after + 1 + num_blocks))
        assert self.pool.allocate_run(num_blocks, after, max_runs) == expected
        self._take(expected)

    def _longest_runs(
        self, num_blocks: int, fits: Callable[[int], bool], max_runs: int
    ) -> list[int] | None:
        """The longest runs of at least num_blocks / max_runs blocks taken whole (at most
        max_runs - 1), then the lowest run holding what is missing; in id order."""
        size = len(self.ref_cnt)
        free = [fits(b) for b in range(size)]
        runs, block_id = [], 0
        while block_id < size:
            end = block_id
            while end < size and free[end]:
                end += 1
            if end - block_id >= -(-num_blocks // max_runs):
                runs.append((end - block_id, block_id))
            block_id = max(end, block_id + 1)
        runs.sort(key=lambda run: -run[0])
        chosen, need = [], num_blocks
        for length, start in runs[: max_runs - 1]:
            chosen.append((start, min(length, need)))
            need -= chosen[-1][1]
            free[start : start + chosen[-1][1]] = [False] * chosen[-1][1]
            if need == 0:
                break
        if need > 0:
            last = next((b for b in range(size - need + 1) if all(free[b : b + need])), None)
            if last is None:
                return None
            chosen.append((last, need))
        return [i for start, take in sorted(chosen) for i in range(start, start + take)]

    def _take(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.free_list.remove(block_id)
            self.ref_cnt[block_id] = 1
            evicted = self._cached_hash_of(block_id)
            if evicted is not None:
                del self.cache[evicted]
                self.reused.discard(block_id)
        self.holders.append(block_ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.cache.clear()
        self.reused.clear()
        self.reader = None  # its next report must be a snapshot

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """A second holder takes a reference to some blocks of an existing holder."""
        owner = data.draw(st.sampled_from(self.holders))
        shared = data.draw(st.lists(st.sampled_from(owner), unique=True)) if owner else []
        self.pool.touch(shared)
        for block_id in shared:
            self.ref_cnt[block_id] += 1
        self.holders.append(list(shared))

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data(), block_hash=hashes, tokens=block_tokens)
    def cache_block(self, data: st.DataObject, block_hash: BlockHash, tokens: tuple) -> None:
        block_id = data.draw(st.sampled_from([b for h in self.holders for b in h]))
        self.pool.cache_block(block_id, block_hash, tokens)
        first_writer = block_hash not in self.cache and self._cached_hash_of(block_id) is None
        if self.pool.enable_caching and first_writer:
            self.cache[block_hash] = (block_id, tokens)

    @precondition(lambda self: self.cache)
    @rule(data=st.data())
    def hit_cached_block(self, data: st.DataObject) -> None:
        """Probe with the exact tokens of a cached block (often one nobody holds any more)."""
        entries = sorted(self.cache.items())
        unheld = [e for e in entries if self.ref_cnt[e[1][0]] == 0]
        block_hash, (_, tokens) = data.draw(st.sampled_from(unheld or entries))
        self.lookup_and_touch(BlockHash(block_hash), tokens)

    @rule(block_hash=hashes, tokens=block_tokens)
    def lookup_and_touch(self, block_hash: BlockHash, tokens: tuple) -> None:
        """A prefix-cache probe (hit, miss or hash collision); a verified hit gets a new holder."""
        hit = self.cache.get(block_hash)
        expected = hit[0] if hit is not None and hit[1] == tokens else None
        assert self.pool.lookup(block_hash, tokens) == expected
        if expected is None:
            return
        self.reused.add(expected)
        self.pool.touch([expected])
        if self.ref_cnt[expected] == 0:
            self.free_list.remove(expected)
        self.ref_cnt[expected] += 1
        self.holders.append([expected])

    @rule(snapshot=st.booleans())
    def report_cache_changes(self, snapshot: bool) -> None:
        """A reader that applies every report (a snapshot replacing what it knew), as the
        router's prefix index does, knows exactly which hashes are cached; the first report,
        and the first after a reset, is a snapshot."""
        changes = self.pool.take_cache_changes(snapshot)
        assert changes.snapshot or (self.reader is not None and not snapshot)
        if changes.snapshot:
            self.reader = set()
        assert self.reader is not None and not set(changes.stored) & set(changes.removed)
        self.reader |= set(changes.stored)
        self.reader -= set(changes.removed)
        assert self.reader == set(self.cache)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_holder(self, data: st.DataObject) -> None:
        """A holder releases all its references, in an order of hypothesis' choosing."""
        holder = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        order = data.draw(st.permutations(holder))
        self.pool.free(order)
        for block_id in order:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_list.append(block_id)  # joins the LRU tail in release order

    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        unheld = [b for b, cnt in enumerate(self.ref_cnt) if cnt == 0]
        bad_ids = unheld + [-1, len(self.ref_cnt)]  # plus ids outside the pool
        with pytest.raises(BlockPoolError):
            self.pool.free([data.draw(st.sampled_from(bad_ids))])

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_integrity()
        assert self.pool.free_block_ids() == self.free_list
        assert [self.pool.ref_cnt(b) for b in range(len(self.ref_cnt))] == self.ref_cnt
        assert self.pool.num_cached_blocks == len(self.cache)
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks

    def teardown(self) -> None:
        """Every holder releases (reversed, so shares go first): the whole pool is free again."""
        for holder in reversed(self.holders):
            self.pool.free_sequence_blocks(holder)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_integrity()


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPool = BlockPoolMachine.TestCase


def test_chained_hash_depends_on_every_earlier_block() -> None:
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7], block_size=2)
    b = hash_prompt_blocks([9, 2, 3, 4, 5, 6], block_size=2)
    assert len(a) == 3 and len(b) == 3  # only full blocks are hashed
    assert a[1] != b[1] and a[2] != b[2]  # same tokens in block 1, different parents
    assert a[0] == hash_block_tokens(None, [1, 2])
    assert a[1] == hash_block_tokens(a[0], [3, 4])


def test_free_evicts_cached_blocks_in_lru_order() -> None:
    pool = BlockPool(3)
    block_ids = pool.allocate(3)
    for i, block_id in enumerate(block_ids):
        pool.cache_block(block_id, BlockHash(100 + i), (i,))
    pool.free_sequence_blocks(block_ids)  # tail first: [2, 1, 0]
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.allocate(1) == [2]  # evicts the block cached under 102 first
    assert pool.lookup(BlockHash(102), (2,)) is None
    assert pool.lookup(BlockHash(100), (0,)) == 0
    assert pool.num_cache_evictions == 1
    pool.free([2])
    pool.check_integrity()


def test_allocate_run_evicts_unhit_cached_blocks_bottom_up_for_new_tables_top_down_for_growth() -> (
    None
):
    pool = BlockPool(8)
    for block_id in pool.allocate(8):
        pool.cache_block(block_id, BlockHash(100 + block_id), (block_id,))
    pool.free(range(8))  # every free block is cached: no run of uncached blocks anywhere
    assert pool.lookup(BlockHash(107), (7,)) == 7  # a prefix hit: block 7 is kept under LRU
    assert pool.allocate_run(2) == [0, 1]  # a new table: the lowest run, evicting
    assert pool.allocate_run(1, after=1) == [2]  # growth in place
    assert pool.allocate_run(2) == [3, 4]
    # Growth that cannot stay in place takes the highest run it may evict, never the hit block.
    assert pool.allocate_run(1, after=2) == [6]
    assert pool.num_cache_evictions == 6 and pool.lookup(BlockHash(107), (7,)) == 7
    pool.check_integrity()


def test_allocate_run_covers_a_new_table_with_the_fewest_runs_in_id_order() -> None:
    pool = BlockPool(12)
    held = pool.allocate(12)
    pool.free([0, 1, 3, 4, 6, 7, 8])  # free runs: 0-1, 3-4, 6-8; none of 5
    assert pool.allocate_run(5) == [0, 1, 6, 7, 8]  # the longest runs, then in id order
    assert pool.allocate_run(2) == [3, 4]
    pool.free([b for b in held if b not in (0, 1, 3, 4, 6, 7, 8)])
    pool.check_integrity()


def test_cache_changes_overflow_into_a_snapshot_when_nobody_reads_them() -> None:
    pool = BlockPool(2)
    assert pool.take_cache_changes().snapshot  # the first report
    for round_index in range(3):  # 6 changes of 2 blocks: past twice the pool's size
        block_ids = pool.allocate(2)
        for offset, block_id in enumerate(block_ids):
            pool.cache_block(block_id, BlockHash(10 * round_index + offset), (round_index,))
        pool.free_sequence_blocks(block_ids)
    changes = pool.take_cache_changes()
    assert changes.snapshot and sorted(changes.stored) == [20, 21] and not changes.removed
    pool.allocate(1)  # evicts one cached block
    later = pool.take_cache_changes()
    assert not later.snapshot and later.stored == [] and len(later.removed) == 1
