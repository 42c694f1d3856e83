"""Which instance's prefix cache holds which prompt blocks: the index KV-aware routing reads.

Workers tell what their prefix caches stored and evicted (engine.block_pool.PrefixCacheChanges)
in the load reports the router asks for every `load_refresh_interval_s` (router/worker_pool.py).
The first report of an instance, the one after a failed or lost report, and one every
`SNAPSHOT_INTERVAL_S` are snapshots, which replace all the index knew of the instance: a lost
report, or a worker that restarted with an empty cache, leaves the index wrong for at most that
long. Between reports the router adds the blocks of each prompt it places (`expect`): the
instance caches them as soon as it has prefilled the prompt, so a burst of prompts with one
prefix follows the first of them before any report says so. A snapshot drops such expectations
with everything else.

Blocks are chained hashes (engine.block_pool.hash_prompt_blocks): a block's hash depends on every
token before it, so equal hashes mean equal prefixes, and a match counts the leading run of a
prompt's blocks that an instance holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.block_pool import BlockHash, PrefixCacheChanges

SNAPSHOT_INTERVAL_S = 10.0


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._held: dict[str, set[BlockHash]] = {}

    def apply(self, instance_id: str, changes: PrefixCacheChanges) -> None:
        """One load report's prefix-cache changes (a snapshot replaces the instance's entries)."""
        if changes.snapshot:
            self.forget(instance_id)
        self._add(instance_id, changes.stored)
        held = self._held.get(instance_id)
        if held is None:
            return
        for block_hash in changes.removed:
            if block_hash in held:
                held.discard(block_hash)
                self._drop_holder(block_hash, instance_id)

    def expect(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The router placed a prompt with these blocks on the instance: it will cache them."""
        self._add(instance_id, block_hashes)

    def forget(self, instance_id: str) -> None:
        """Drop everything known of the instance (it was lost, or a snapshot follows)."""
        for block_hash in self._held.pop(instance_id, ()):
            self._drop_holder(block_hash, instance_id)

    def matching_blocks(
        self, block_hashes: Sequence[BlockHash], instance_ids: Iterable[str]
    ) -> dict[str, int]:
        """For each instance, how many leading blocks of the prompt its prefix cache holds."""
        matched = dict.fromkeys(instance_ids, 0)
        alive = set(matched)
        for depth, block_hash in enumerate(block_hashes, start=1):
            alive &= self._holders.get(block_hash, set())
            if not alive:
                break
            for instance_id in alive:
                matched[instance_id] = depth
        return matched

    def num_blocks(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))

    def _add(self, instance_id: str, block_hashes: Iterable[BlockHash]) -> None:
        held = self._held.setdefault(instance_id, set())
        for block_hash in block_hashes:
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(instance_id)

    def _drop_holder(self, block_hash: BlockHash, instance_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[block_hash]
