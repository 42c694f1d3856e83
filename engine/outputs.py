"""What the engine reports: per step, per finished request, and its counters. Plain dataclasses,
picklable, so a worker can send them across a process boundary as they are."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of the raw logits), its rank in
    the vocabulary (1 is the most likely), and the `top` most likely (id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepOutput:
    """One request's progress in one engine step: the tokens it gained, and whether it ended.

    A request that finishes without a new token (abort, error) still gets one StepOutput with
    `new_token_ids == []` and `finished == True`, so every request's end is reported exactly once.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # one of engine.request.FINISH_REASONS' values once finished
    error: str | None = None  # what went wrong, when finish_reason == "error"
    handed_off: bool = False  # finished here with its first token; it decodes elsewhere
    # On the last output: its speculative tokens proposed and accepted here (engine/speculative/)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # With SamplingParams.logprobs: one per new token. With prompt_logprobs, on the output of the
    # first token: one per prompt token (None for the first, which has no context).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestOutput:
    """A finished request as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only (EOS or the stop token included when it ended so)
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens whose compute the prefix cache skipped
    num_preemptions: int = 0
    error: str | None = None
    # speculative decoding: tokens proposed for it and accepted by the model (0 without)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    logprobs: list[TokenLogprob] | None = None  # as StepOutput's, over the whole output
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of one scheduler's load and counters (cumulative since it started)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_prefix_hit_tokens: int  # tokens whose KV came from the prefix cache at admission
    num_prefix_queried_tokens: int  # tokens looked up in the prefix cache at admission
    num_preemptions: int
    num_queued_prompt_tokens: int  # tokens of waiting requests still to compute
    num_decoding: int = 0  # running requests past their first token
    num_spec_proposed: int = 0  # speculative tokens proposed and accepted, over all requests
    num_spec_accepted: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        if self.num_prefix_queried_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens
