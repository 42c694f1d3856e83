"""The scheduler's side of speculation: what each decode proposes, and what its verification
taught (counts, the adaptive length).

Cost check per step: a verified token costs about what a prompt token does (`price`, learned
by engine/step_costs.py), while a decode step of B sequences costs `step`; a proposal of k
tokens at acceptance rate a pays when the tokens it is expected to add, a + a^2 + ... + a^k,
are worth its price: (a + ... + a^k) / k >= price * B / step. At batch 1 the right side is
small (one token reads the weights, a few more cost little); in a large CPU batch, where a step
is compute bound, only requests that copy well still propose. Until both costs are learned
every request proposes.

With a draft model (draft.py), `begin_step` drafts for every decode of the step in one batch
(the running ones and those whose KV just landed) and `propose` hands out the result. A draft
forward of the batch costs `draft.forward_s`, so a proposed token costs that over B more: the
threshold gains forward_s / step. A request's first PROBE_VERIFICATIONS verifications skip that
term, so its rate is measured before the draft's price can turn it off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.request import Request
from engine.speculative import ngram
from engine.speculative.config import SpeculativeConfig
from engine.speculative.state import SpecState
from engine.step_costs import StepCosts

if TYPE_CHECKING:
    import torch

    from engine.speculative.draft import DraftModel


PROBE_VERIFICATIONS = 2  # a request's verifications before a draft's cost counts


class Speculator:
    """Proposes tokens for decodes under one SpeculativeConfig; counts over all requests."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        costs: StepCosts | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        self.draft = draft
        self._drafted: dict[str, list[int]] = {}  # this step's draft-model proposals
        self.max_model_len = max_model_len
        self.costs = costs
        self.num_proposed = 0
        self.num_accepted = 0
        self._threshold = 0.0  # this step's worth a proposed token must reach (module doc)
        self._draft_threshold = 0.0  # what the draft's own forwards add to it

    def begin_step(self, running: list[Request], landed: Iterable[Request] = ()) -> None:
        """Price this step's proposals for a batch of the `running` requests; with a draft
        model, draft for the decodes among them and the `landed` ones."""
        self._threshold = 0.0
        costs = self.costs
        if costs is not None and running:
            batch_size = len(running)
            context = sum(r.num_tokens for r in running) // batch_size
            step = costs.decode_step_s(batch_size)
            price = costs.prefill_s(1, context)
            if step and price is not None:
                self._threshold = min(1.0, price * batch_size / step)
            if step and self.draft is not None and self.draft.forward_s is not None:
                self._draft_threshold = self.draft.forward_s / step
        if self.draft is not None:
            self._drafted.clear()
            self.draft.probs.clear()
            decodes = [r for r in (*running, *landed) if r.num_tokens - r.num_computed_tokens == 1]
            sizes = [self._num_tokens(r, self.config.num_tokens) for r in decodes]
            chosen = [(r, k) for r, k in zip(decodes, sizes, strict=True) if k > 0]
            if chosen:
                drafts = self.draft.propose([r for r, _ in chosen], [k for _, k in chosen])
                for (request, _), draft in zip(chosen, drafts, strict=True):
                    self._drafted[request.request_id] = draft

    def release(self, request: Request) -> None:
        """The request's blocks went back (finish, abort, preemption): so do its draft's."""
        if self.draft is not None:
            self.draft.release(request.request_id)

    def draft_probs(self, request_ids: Sequence[str]) -> list[torch.Tensor | None]:
        """Per request, q of its proposals [k, vocab] (None: greedy, or a point mass)."""
        probs = self.draft.probs if self.draft is not None else {}
        return [probs.get(request_id) for request_id in request_ids]

    def propose(self, request: Request, room: int) -> list[int]:
        """Tokens to verify after the request's last one this step: none for a request that
        turned speculation off or has nothing to copy; at most `room`, and never so many that
        accepting all would pass its max_tokens or max_model_len."""
        if self.draft is not None:
            return self._drafted.pop(request.request_id, [])[:room]
        num_tokens = self._num_tokens(request, room)
        if num_tokens <= 0:
            return []
        config = self.config
        return ngram.propose(
            request.all_token_ids, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def _num_tokens(self, request: Request, room: int) -> int:
        """How many tokens the request may propose this step (0: none); counts a paused step."""
        params = request.params
        if not params.may_propose or not request.decodes_here:
            return 0
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
        threshold = self._threshold
        if state.num_verifications >= PROBE_VERIFICATIONS:
            threshold = min(1.0, threshold + self._draft_threshold)
        num_tokens = min(num_tokens, _worth(state.rate, threshold))
        if num_tokens <= 0 or not state.wants_proposal():
            return 0
        return num_tokens

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        assert request.spec is not None
        request.spec.observe(num_proposed, num_accepted)
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted


def _worth(rate: float, threshold: float) -> int:
    """The largest k with (rate + rate^2 + ... + rate^k) / k >= threshold (at most 32)."""
    total, power, k = 0.0, 1.0, 0
    while k < 32:
        power *= rate
        if (total + power) / (k + 1) < threshold:
            break
        total += power
        k += 1
    return k
