"""A request's state inside one worker: its tokens, its blocks, how far it has been computed."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.outputs import TokenLogprob
    from engine.slo import RequestSLO
    from engine.speculative.state import SpecState
    from engine.structured.grammars import GrammarState


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished (`status > PREEMPTED`)."""

    WAITING = 0
    WAITING_FOR_KV = 1  # decode side: blocks reserved, KV not landed yet
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH = 5  # max_tokens or the model's length
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_HANDED_OFF = 8  # first token sampled here; the decode runs on another instance

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """One sequence. `token_ids` = prompt + generated; `num_computed_tokens` of them have KV.

    There is no prefill/decode flag: a request needs prefill while
    num_computed_tokens < num_tokens - 1 ... i.e. the scheduler computes
    `num_tokens - num_computed_tokens` new tokens for it (1 during decode).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # leading block_table entries given back once every layer's window passed them (their ids
    # now repeat the first kept block's, so they are never freed twice)
    num_released_blocks: int = 0
    decodes_here: bool = True  # False: its KV connector hands it off after its first token
    slo: RequestSLO | None = None  # its latency objectives, when the router sent them
    first_token_at: float | None = None  # time.time() of its first token, wherever it came from
    spec: SpecState | None = None  # its speculation, on an engine that speculates
    # With params.prompt_logprobs: one per prompt token computed so far (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: GrammarState | None = None  # with params.structured: its compile and matcher

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt's log-probabilities are still to compute (none of its output exists)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def stop_status(
        self, token_id: int, eos_token_ids: Collection[int], max_model_len: int
    ) -> RequestStatus | None:
        """How the request ends with `token_id` just appended: stopped (EOS, unless ignored, or
        a stop token, or its grammar ended), at its length (max_tokens or the model's), or not
        yet (None)."""
        params = self.params
        if (not params.ignore_eos and token_id in eos_token_ids) or (
            token_id in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated(self):
            return RequestStatus.FINISHED_STOPPED  # it took a stop token, even with ignore_eos
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
