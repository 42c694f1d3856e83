"""Per-request sampling parameters, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    speculative: bool = True

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

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
