"""Dispatch policies: which prefill instance computes a prompt, which decode instance holds it.

Every policy sees the same `InstanceState` snapshots: the instance's last load report plus the
router's own counts, which are exact and fresh (load reports lag by up to one refresh interval).
Invariants for every policy: `select` is called once per dispatch with a non-empty list of healthy
candidates, returns one of them, and may update its own state on the assumption that the
request goes there.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.block_pool import BlockHash, hash_prompt_blocks
from router.worker_api import InstanceLoad


@dataclass(frozen=True)
class InstanceState:
    instance_id: str
    load: InstanceLoad
    num_outstanding_prompt_tokens: int = 0  # dispatched, first token not back yet
    num_active_requests: int = 0  # dispatched, not finished
    num_blocks_reserved_since_load: int = 0  # router's estimate, reset by each load report

    @property
    def num_free_blocks_estimate(self) -> int:
        return self.load.num_free_blocks - self.num_blocks_reserved_since_load


class PrefillPolicy(ABC):
    name: str

    @abstractmethod
    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState: ...


class DecodePolicy(ABC):
    name: str

    @abstractmethod
    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState: ...


def _least_tokens_key(state: InstanceState) -> tuple[int, int, str]:
    return (state.num_outstanding_prompt_tokens, state.num_active_requests, state.instance_id)


class LeastOutstandingTokens(PrefillPolicy):
    """The instance with the fewest prompt tokens still to prefill: a proxy for its queue time."""

    name = "least_tokens"

    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState:
        return min(candidates, key=_least_tokens_key)


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState:
        ordered = sorted(candidates, key=lambda s: s.instance_id)
        return ordered[next(self._counter) % len(ordered)]


class PrefixAffinity(PrefillPolicy):
    """Send a prompt where its longest prefix went before, so the prefix cache there hits.

    The router remembers, per instance, the chained hashes of the prompt blocks it sent there
    (the same `hash_prompt_blocks` the workers' prefix caches use, so equal hashes mean equal
    prefixes), most recent last, up to `max_hashes_per_instance`. A prompt with no remembered
    prefix, or whose best instance has `max_imbalance_tokens` more outstanding tokens than the
    least loaded, goes by least outstanding tokens instead: affinity must not pile work on one
    instance while another idles.
    """

    name = "prefix_affinity"

    def __init__(
        self,
        block_size: int,
        max_hashes_per_instance: int = 65536,
        max_imbalance_tokens: int = 4096,
    ) -> None:
        self._block_size = block_size
        self._max_hashes = max_hashes_per_instance
        self._max_imbalance_tokens = max_imbalance_tokens
        self._hashes: dict[str, OrderedDict[BlockHash, None]] = {}

    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState:
        block_hashes = hash_prompt_blocks(prompt_token_ids, self._block_size)
        least_loaded = min(candidates, key=_least_tokens_key)
        best, best_num_blocks = least_loaded, 0
        for state in sorted(candidates, key=_least_tokens_key):
            num_blocks = self.num_matching_blocks(state.instance_id, block_hashes)
            if num_blocks > best_num_blocks:
                best, best_num_blocks = state, num_blocks
        excess = best.num_outstanding_prompt_tokens - least_loaded.num_outstanding_prompt_tokens
        if excess > self._max_imbalance_tokens:
            best = least_loaded
        self._remember(best.instance_id, block_hashes)
        return best

    def num_matching_blocks(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the prompt were sent to the instance before."""
        known: Mapping[BlockHash, None] = self._hashes.get(instance_id, {})
        for num_blocks, block_hash in enumerate(block_hashes):
            if block_hash not in known:
                return num_blocks
        return len(block_hashes)

    def _remember(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> None:
        known = self._hashes.setdefault(instance_id, OrderedDict())
        for block_hash in block_hashes:
            known[block_hash] = None
            known.move_to_end(block_hash)
        while len(known) > self._max_hashes:
            known.popitem(last=False)


class MostFreeBlocks(DecodePolicy):
    """The decode instance with the most free KV blocks, then the fewest running sequences."""

    name = "most_free_blocks"

    def select(
        self, prompt_token_ids: Sequence[int], candidates: Sequence[InstanceState]
    ) -> InstanceState:
        return min(
            candidates,
            key=lambda s: (
                -s.num_free_blocks_estimate,
                s.num_active_requests,
                s.instance_id,
            ),
        )


def make_prefill_policy(name: str, block_size: int) -> PrefillPolicy:
    if name == "least_tokens":
        return LeastOutstandingTokens()
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix_affinity":
        return PrefixAffinity(block_size)
    raise ValueError(f"unknown prefill policy {name!r}")


def make_decode_policy(name: str) -> DecodePolicy:
    if name == "most_free_blocks":
        return MostFreeBlocks()
    raise ValueError(f"unknown decode policy {name!r}")
