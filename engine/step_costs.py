"""What a step costs on this engine, learned from the steps it ran (for the prefill gate,
engine/slo.py). Pure Python.

Two straight lines, each an exponentially weighted least-squares fit over recent steps:

    decode step (s)         = c0 + c1 * batch size          (steps with no prompt tokens)
    prompt chunk (s / token) = p0 + p1 * mean context       (the step's time beyond its decodes'
                                                             step, over its prompt tokens)

A prompt token attends to every token before it, so its cost grows with the context its chunk
sits at (the mean of the chunk's positions). A speculative decode counts as a decode plus its
proposed tokens as prompt tokens: they cost what prompt tokens at that context cost. Weights decay per observation (`DECAY`), so the fit
follows a machine whose speed moves. Until a line has seen enough steps it answers None and the
gate lets every chunk through.
"""

from __future__ import annotations

from engine.batch import ScheduledBatch

DECAY = 0.97  # each older observation weighs this much less (about 30 steps in memory)
MIN_WEIGHT = 3.0  # observations a line needs before it answers
MIN_PROMPT_TOKENS = 16  # a step with fewer prompt tokens says too little about their cost


class _Line:
    """y = a + b x, fit by exponentially weighted least squares."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    def at(self, x: float) -> float | None:
        if self._w < MIN_WEIGHT:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = 0.0
        if var > 1e-9 * max(1.0, mean_x * mean_x):
            slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var)
        return max(0.0, mean_y + slope * (x - mean_x))


class StepCosts:
    """The engine's own step times, by what each step computed."""

    def __init__(self) -> None:
        self._decode = _Line()  # x: batch size, y: seconds
        self._prompt = _Line()  # x: mean context of the prompt tokens, y: seconds per token

    def observe(self, batch: ScheduledBatch, duration_s: float) -> None:
        num_decodes = num_prompt = 0
        weighted_ctx = 0.0
        for chunk in batch.chunks:
            n = chunk.num_new_tokens
            if chunk.num_draft:
                num_decodes += 1
                num_prompt += chunk.num_draft
                weighted_ctx += chunk.num_draft * (chunk.start_pos + n / 2)  # at 1..num_draft
            elif n == 1 and chunk.start_pos > 0 and chunk.sample:
                num_decodes += 1
            else:
                num_prompt += n
                weighted_ctx += n * (chunk.start_pos + (n - 1) / 2)
        if num_prompt == 0:
            if num_decodes:
                self._decode.add(num_decodes, duration_s)
            return
        if num_prompt < MIN_PROMPT_TOKENS:
            return
        decodes_s = self.decode_step_s(num_decodes) if num_decodes else 0.0
        if decodes_s is None:
            return
        per_token = max(0.0, duration_s - decodes_s) / num_prompt
        self._prompt.add(weighted_ctx / num_prompt, per_token)

    def decode_step_s(self, batch_size: int) -> float | None:
        """One decode step of `batch_size` sequences; None until learned."""
        return self._decode.at(batch_size)

    def prefill_s(self, num_tokens: int, start_pos: int = 0) -> float | None:
        """A chunk of `num_tokens` prompt tokens after `start_pos` computed ones; None until
        learned."""
        if num_tokens <= 0:
            return 0.0
        per_token = self._prompt.at(start_pos + (num_tokens - 1) / 2)
        return None if per_token is None else per_token * num_tokens
