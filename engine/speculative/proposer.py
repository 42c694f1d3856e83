"""The scheduler's side of speculation: what each decode proposes, and what its verification
taught (counts, the adaptive length)."""

from __future__ import annotations

from engine.request import Request
from engine.speculative import ngram
from engine.speculative.config import SpeculativeConfig
from engine.speculative.state import SpecState


class Speculator:
    """Proposes tokens for decodes under one SpeculativeConfig; counts over all requests."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_proposed = 0
        self.num_accepted = 0

    def propose(self, request: Request, room: int) -> list[int]:
        """Tokens to verify after the request's last one this step: none for a request that
        turned speculation off or has nothing to copy; at most `room`, and never so many that
        accepting all would pass its max_tokens or max_model_len."""
        if not request.params.speculative or not request.decodes_here:
            return []
        config = self.config
        state = request.spec
        if state is None:
            state = request.spec = SpecState(config.num_tokens)
        num_tokens = min(
            state.num_tokens,
            room,
            request.params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if num_tokens <= 0 or not state.wants_proposal():
            return []
        return ngram.propose(
            request.all_token_ids, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        assert request.spec is not None
        request.spec.observe(num_proposed, num_accepted)
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
