"""The adaptive placer's latency model: the planner's StepModel (from a profile file) in
seconds, corrected online by what the workers measure (placer.py uses it).

Two factors, each an exponential average of measured over profiled: `speed`, from every first
token's prefill compute against the profiled one (a profile taken on another day, or a machine
whose speed moved, still predicts in the right units), and `decode_speed`, from the decode
steps the instances' engines measure (engine/step_costs.py, in their load reports) against the
profile's; until an engine has reported one, the decode step goes at `speed`. They are learned
apart: tied (a decode bias on top of the prefill speed), every jump of the prefill speed moved
the decode prediction until the next reports brought the bias back, and a split's prefill-only
instance, whose prompts are measured in batches, took the prefill speed from 1.5 to 3.0 within
seconds.
"""

from __future__ import annotations

import math

from planner.latency import StepModel, transfer_ms
from planner.profile import load_profile

SPEED_ALPHA = 0.2  # weight of each new measurement
# The unloaded speed: the lowest the first tokens show lately. Each one lets it rise by this
# share at most (it forgets a faster past in about a hundred prompts) and pulls it half-way
# down to a lower one.
BASE_SPEED_RISE = 0.01
SPEED_BOUNDS = (0.25, 8.0)


class LatencyModel:
    """Step times in seconds from a profile's StepModel, times the learned speed factor."""

    def __init__(self, step: StepModel, chunk_size: int = 512) -> None:
        self.step = step
        self.chunk_size = chunk_size
        self.speed = 1.0  # measured over profiled prompt compute
        # The same without the load: a prompt measured beside decodes, on a core the router and
        # the other instance share, takes longer than one on an instance that only prefills;
        # the speed of the fastest lately is what a prefill-only instance would see.
        self.base_speed: float | None = None
        # Measured decode step over profiled (None: none measured yet, the decode goes at
        # `speed`).
        self.decode_speed: float | None = None

    @classmethod
    def from_file(cls, path: str, model: str | None = None) -> LatencyModel:
        profile = load_profile(path, model)
        return cls(StepModel(profile.tp(min(profile.by_tp))))

    def decode_step_s(self, batch_size: int, sum_ctx: float) -> float:
        if batch_size <= 0:
            return 0.0
        speed = self.speed if self.decode_speed is None else self.decode_speed
        return speed * self.step.decode_stage_ms(batch_size, sum_ctx) / 1e3

    @property
    def decode_bias(self) -> float:
        """The decode speed over the prefill speed: what the profile's decode step misses on
        this machine beyond its prompts'."""
        return 1.0 if self.decode_speed is None else self.decode_speed / self.speed

    def prefill_s(self, num_tokens: int, batch_size: int = 0, sum_ctx: float = 0.0) -> float:
        """A prompt's compute: its chunks, each in a step beside `batch_size` decodes."""
        return self.speed * self.profiled_prefill_s(num_tokens, batch_size, sum_ctx)

    def unloaded_prefill_s(self, num_tokens: int) -> float:
        """A prompt's compute alone on an instance that only prefills, at the base speed."""
        speed = self.speed if self.base_speed is None else min(self.base_speed, self.speed)
        return speed * self.profiled_prefill_s(num_tokens)

    def profiled_prefill_s(
        self, num_tokens: int, batch_size: int = 0, sum_ctx: float = 0.0
    ) -> float:
        """The same at the profile's own speed."""
        if num_tokens <= 0:
            return 0.0
        alone = self.step.prefill_stage_ms(num_tokens, float(num_tokens) ** 2)
        num_chunks = math.ceil(num_tokens / self.chunk_size)
        beside = num_chunks * self.step.decode_stage_ms(batch_size, sum_ctx) if batch_size else 0.0
        return (alone + beside) / 1000.0

    def transfer_s(self, num_tokens: int) -> float:
        profile = self.step.profile
        if profile.transfer_GBps is None or profile.kv_bytes_per_token is None:
            return 0.0
        return (
            transfer_ms(
                num_tokens,
                profile.kv_bytes_per_token,
                profile.transfer_GBps,
                profile.transfer_per_message_ms,
            )
            / 1000.0
        )

    def observe(self, profiled_s: float, measured_s: float) -> None:
        """A prompt's measured compute against its profiled one (`profiled_prefill_s`)."""
        if profiled_s <= 0 or measured_s <= 0:
            return
        ratio = measured_s / profiled_s  # the speed that would have predicted it
        self.speed = _blend(self.speed, ratio)
        base = self.base_speed
        if base is None or ratio < base:
            base = ratio if base is None else (base + ratio) / 2
        else:
            base = min(base * (1 + BASE_SPEED_RISE), ratio)
        self.base_speed = min(max(base, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])

    def observe_decode_step(self, batch_size: int, sum_ctx: float, measured_s: float) -> None:
        """A decode step an engine measured at `batch_size` against the profile's."""
        profiled_s = self.step.decode_stage_ms(batch_size, sum_ctx) / 1e3
        if profiled_s <= 0 or measured_s <= 0:
            return
        current = self.speed if self.decode_speed is None else self.decode_speed
        self.decode_speed = _blend(current, measured_s / profiled_s)


def _blend(old: float, measured: float) -> float:
    blended = (1 - SPEED_ALPHA) * old + SPEED_ALPHA * measured
    return min(max(blended, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])
