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
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_pool import BlockHash, hash_prompt_blocks
from router.prefix_index import PrefixIndex
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
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        """`max_tokens`: the request's (a colocated instance also decodes it)."""

    def placed(self, prompt_token_ids: Sequence[int], instance_id: str) -> int:
        """The prompt went to the instance: the prompt tokens it has to compute there (the
        router counts them as that instance's queue until the first token)."""
        return len(prompt_token_ids)


class DecodePolicy(ABC):
    name: str

    @abstractmethod
    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        """`max_tokens`: the request's (its KV grows to the prompt plus that many tokens)."""


def _least_tokens_key(state: InstanceState) -> tuple[int, int, str]:
    return (state.num_outstanding_prompt_tokens, state.num_active_requests, state.instance_id)


class LeastOutstandingTokens(PrefillPolicy):
    """The instance with the fewest prompt tokens still to prefill: a proxy for its queue time."""

    name = "least_tokens"

    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        return min(candidates, key=_least_tokens_key)


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        ordered = sorted(candidates, key=lambda s: s.instance_id)
        return ordered[next(self._counter) % len(ordered)]


class KVAware(PrefillPolicy):
    """The instance that computes the fewest tokens before this request is done, counting what
    its prefix cache already holds:

        cost = prompt tokens queued there + this prompt's tokens its cache lacks
             + its active requests x this request's max_tokens

    The last term is the decode work the request shares steps with: each request active there
    adds a token to each of the steps that decode this one (a colocated instance decodes what it
    prefills; for a prefill-only instance it counts its in-flight prompts). The cache contents
    come from the workers' own reports (router/prefix_index.py), so an evicted prefix stops
    attracting prompts. A long cached prefix outweighs a short queue and a light decode load,
    and loses to a long queue or a heavy one: a system prompt that every conversation shares
    does not pull all of them onto one instance. The queue counts what each placed prompt's
    cache lacked (`placed`), not its whole length. Ties go to fewer active requests, then the id.
    Dynamo's cost counts the KV blocks running sequences hold instead of their decode steps;
    measured here (benchmarks/kv_routing.py) that term outweighed any cached history and gave
    round robin's hit rate.
    """

    name = "kv_aware"

    def __init__(self, block_size: int, index: PrefixIndex) -> None:
        self._block_size = block_size
        self.index = index
        # The last select's prompt, its block hashes and matches: `placed` follows it with the
        # same prompt, and need not hash it and walk the index again.
        self._last: tuple[Sequence[int], list[BlockHash], dict[str, int]] | None = None

    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        block_hashes = hash_prompt_blocks(prompt_token_ids, self._block_size)
        matched = self.index.matching_blocks(block_hashes, (s.instance_id for s in candidates))
        self._last = (prompt_token_ids, block_hashes, matched)
        num_prompt = len(prompt_token_ids)

        def cost(state: InstanceState) -> tuple[int, int, str]:
            cached = self._cached(matched[state.instance_id], num_prompt)
            prefill = state.num_outstanding_prompt_tokens + num_prompt - cached
            decode = state.num_active_requests * max(max_tokens, 1)
            return (prefill + decode, state.num_active_requests, state.instance_id)

        return min(candidates, key=cost)

    def cached_tokens(
        self, prompt_token_ids: Sequence[int], instance_ids: Sequence[str]
    ) -> dict[str, int]:
        """The prompt tokens each instance's prefix cache holds (what a prefill there skips)."""
        block_hashes = hash_prompt_blocks(prompt_token_ids, self._block_size)
        matched = self.index.matching_blocks(block_hashes, instance_ids)
        return {i: self._cached(matched[i], len(prompt_token_ids)) for i in instance_ids}

    def placed(self, prompt_token_ids: Sequence[int], instance_id: str) -> int:
        """What the instance will compute, and from now on: the prompt's blocks are expected
        there (it caches them once it has prefilled the prompt)."""
        last, self._last = self._last, None
        if last is not None and last[0] is prompt_token_ids and instance_id in last[2]:
            block_hashes, matched = last[1], last[2][instance_id]
        else:
            block_hashes = hash_prompt_blocks(prompt_token_ids, self._block_size)
            matched = self.index.matching_blocks(block_hashes, (instance_id,))[instance_id]
        self.index.expect(instance_id, block_hashes)
        return len(prompt_token_ids) - self._cached(matched, len(prompt_token_ids))

    def _cached(self, num_matched_blocks: int, num_prompt: int) -> int:
        # the last prompt token is computed even on a full hit: its logits give the token
        return min(num_matched_blocks * self._block_size, num_prompt - 1)


class LeastBatch(DecodePolicy):
    """The decode instance this request slows least and that can hold it: among those whose
    free blocks (less the router's reservations since their last report) hold the request's
    longest form, prompt plus max_tokens, the one with the fewest active requests (the batch
    whose steps set its TPOT), then the most free blocks; when none can hold it, the one with
    the most free blocks (it may have to preempt there). Free blocks decide only where memory
    runs short, so a decode instance with a large, idle pool does not draw every request while
    another with a smaller batch has room."""

    name = "least_batch"

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size

    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        need = -(-(len(prompt_token_ids) + max_tokens) // self._block_size)
        fits = [s for s in candidates if s.num_free_blocks_estimate >= need]
        if not fits:
            return min(candidates, key=_most_free_key)
        return min(fits, key=lambda s: (s.num_active_requests, *_most_free_key(s)))


class MostFreeBlocks(DecodePolicy):
    """The decode instance with the most free KV blocks, then the fewest running sequences."""

    name = "most_free_blocks"

    def select(
        self,
        prompt_token_ids: Sequence[int],
        candidates: Sequence[InstanceState],
        max_tokens: int = 1,
    ) -> InstanceState:
        return min(candidates, key=_most_free_key)


def _most_free_key(state: InstanceState) -> tuple[int, int, str]:
    return (-state.num_free_blocks_estimate, state.num_active_requests, state.instance_id)


def make_prefill_policy(
    name: str, block_size: int, index: PrefixIndex | None = None
) -> PrefillPolicy:
    if name == "least_tokens":
        return LeastOutstandingTokens()
    if name == "round_robin":
        return RoundRobin()
    if name == "kv_aware":
        if index is None:
            raise ValueError("the kv_aware policy needs the pool's PrefixIndex")
        return KVAware(block_size, index)
    raise ValueError(f"unknown prefill policy {name!r}")


def make_decode_policy(name: str, block_size: int) -> DecodePolicy:
    if name == "least_batch":
        return LeastBatch(block_size)
    if name == "most_free_blocks":
        return MostFreeBlocks()
    raise ValueError(f"unknown decode policy {name!r}")
