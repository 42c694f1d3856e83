"""Per-request sampling parameters, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutput

# Below this a temperature means greedy, as in vLLM: dividing logits by a tinier one overflows
# them (1e-45 is 0 in float32, and every token came out as id 0).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    A temperature below MIN_TEMPERATURE (0 included) means greedy. top_k <= 0 and top_p == 1.0 disable those filters.
    `seed` makes sampling reproducible per request (same seed, same prompt: same output).
    `stop_token_ids` end a sequence in addition to the model's EOS ids (unless `ignore_eos`).
    `speculative=False` decodes this request one token per step even where the engine speculates.

    Outputs: `logprobs=k` returns each sampled token's log-probability and the k most likely
    tokens' (0: only the sampled one's); `prompt_logprobs=k` the same for every prompt token but
    the first (computed at prefill, so such a request never takes its prompt from the prefix
    cache). Log-probabilities are the model's: log-softmax of the raw logits, before the
    processors below and before temperature.
    Processors, in vLLM's order and OpenAI's meaning: `logit_bias` adds to a token's logit;
    `min_tokens` masks EOS and the stop tokens until that many tokens came out;
    `repetition_penalty` (transformers' and vLLM's: a logit of any token in the prompt or the
    output is divided by it when positive, multiplied when negative); `frequency_penalty` and
    `presence_penalty` subtract count * f + (count > 0) * p, counting the output tokens only.
    `prior_output_tokens`: how many of the prompt's last tokens were this request's own output
    before a migration moved it (router/recovery.py); the two penalties count them as output, so
    a moved stream goes on as the undisturbed one would.
    `structured`: a JSON schema, regex, choice or grammar the output must match; its mask comes
    before the processors, and log-probabilities are then those of the masked logits (vLLM's).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    speculative: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    prior_output_tokens: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also false for NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not isinstance(self.prior_output_tokens, int) or self.prior_output_tokens < 0:
            raise ValueError(
                f"prior_output_tokens must be an integer >= 0, got {self.prior_output_tokens!r}"
            )
        bias = dict(self.logit_bias)  # a dict or pairs; one entry per token
        if any(
            not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0 for t, b in bias.items()
        ):
            raise ValueError(
                f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {bias!r}"
            )
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def may_propose(self) -> bool:
        """Whether speculation may propose tokens for it: verification samples without the
        processors or a grammar's mask, and reports no log-probabilities."""
        return self.speculative and not (
            self.processes_logits or self.logprobs is not None or self.structured is not None
        )

    @property
    def processes_logits(self) -> bool:
        """Whether a processor (bias, min_tokens, a penalty) changes this request's logits."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )
