"""How a decode instance speculates: checked on construction, like EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup) proposes up to `num_tokens` tokens per step: what
    followed the latest earlier occurrence of the request's last n tokens, for the longest n in
    [prompt_lookup_min, prompt_lookup_max] that matches. Per request, the number proposed adapts
    to how many were accepted, down to none for a while when nothing is (state.py).

    `method` "draft" proposes with `draft_model` (a Hugging Face folder of a small model with
    the target's tokenizer, engine/speculative/draft.py): up to `num_tokens` tokens a step, one
    draft forward each, the same adaptive length. The prompt lookup knobs do not apply to it.
    """

    method: str = "ngram"
    num_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError(
                "speculative method 'draft' needs draft_model: the folder of a small Hugging "
                "Face model with the target's tokenizer"
            )
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError("speculative draft_model is only for method 'draft'")
        for name in ("num_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.num_tokens > 32:
            raise ValueError(f"speculative num_tokens must be at most 32, got {self.num_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
