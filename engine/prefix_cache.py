"""The scheduler's side of the prefix cache: which cached blocks a new request can reuse, and
registering a request's blocks in the pool's cache once they are full and computed.

The pool holds the cache itself (hash -> block, LRU eviction, token verification); this object
keeps, per request, the chained hashes of the blocks already registered, so each full block is
hashed once in the request's life rather than once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockHash, BlockPool, hash_block_tokens
from engine.request import Request


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without building the whole list (this is per step)."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    outputs = request.output_token_ids
    if start >= num_prompt:
        return outputs[start - num_prompt : end - num_prompt]
    return prompt[start:] + outputs[: end - num_prompt]


class PrefixCache:
    """Matches and registers full blocks of requests; counts hit and queried tokens."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enabled = block_pool.enable_caching
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        # request_id -> chained hashes of its leading full blocks that are known to the cache.
        self._block_hashes: dict[str, list[BlockHash]] = {}

    def match(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens. Does not touch them.

        The block holding the last token is never reused: that token must be computed so that
        its logits exist to sample from.
        """
        if not self.enabled:
            return []
        block_size = self.block_size
        num_reusable = (request.num_tokens - 1) // block_size
        hashes: list[BlockHash] = []
        block_ids: list[int] = []
        parent: BlockHash | None = None
        for i in range(num_reusable):
            tokens = token_slice(request, i * block_size, (i + 1) * block_size)
            parent = hash_block_tokens(parent, tokens)
            block_id = self.block_pool.lookup(parent, tokens)
            if block_id is None:
                break
            hashes.append(parent)
            block_ids.append(block_id)
        self._block_hashes[request.request_id] = hashes
        return block_ids

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens

    def register(self, request: Request) -> None:
        """Cache every full block of the request whose KV is now computed."""
        if not self.enabled:
            return
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        if len(hashes) >= num_full:
            return  # the common decode step: no block filled up
        self._register_blocks(request, hashes, num_full)

    def _register_blocks(self, request: Request, hashes: list[BlockHash], num_full: int) -> None:
        block_size = self.block_size
        parent = hashes[-1] if hashes else None
        block_table: Sequence[int] = request.block_table
        for i in range(len(hashes), num_full):
            tokens = token_slice(request, i * block_size, (i + 1) * block_size)
            parent = hash_block_tokens(parent, tokens)
            self.block_pool.cache_block(block_table[i], parent, tokens)
            hashes.append(parent)

    def forget(self, request_id: str) -> None:
        """The request released its blocks (finished, aborted, preempted)."""
        self._block_hashes.pop(request_id, None)
