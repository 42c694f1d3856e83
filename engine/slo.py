"""Latency objectives inside the engine: a request's SLOs, and the prefill gate that holds a
prompt chunk back while running it would make a decode miss its TPOT SLO.

A prompt chunk shares its step with every running decode, so a 0.4 s chunk adds 0.4 s to one
token of each: with a TPOT SLO of two decode steps and 16 tokens to go, that alone breaks it.
A request's TPOT is a mean, (last token - first token) / (tokens - 1), so a decode has slack:

    deadline = first token at + TPOT_TARGET * tpot_slo * (max_tokens - 1)
    slack    = deadline - now - (tokens still to come) * decode step

A chunk fits when its cost (engine/step_costs.py) stays inside the slack of every decode it
would ride with, less a margin. A chunk that does not fit waits (decode-only steps go on) while
waiting saves one of the decodes it breaks: one that ends before the prompt must start to meet
TTFT_TARGET of its own TTFT SLO (the rest is for the estimate's error). Past that, or when the
decodes it breaks outlast that anyway, it runs: so a prompt waits at most until that deadline
less its own compute, and nobody starves, and prompts held for nothing do not pile up into
one long step. (A chatbot decode 100 tokens from its end
is not saved by holding a prompt whose TTFT allows 1.2 s; a summary 10 tokens from its end is.)
A decode that slipped past its target keeps what its SLO itself still allows (so an estimate
error does not leave it to every prompt that comes); one past its SLO is not protected (it
misses either way). A request without SLOs is never held and its chunk still uses the decodes'
slack.

Compared with a per-step prefill token budget (SARATHI-Serve), holding a whole chunk keeps the
prompt's compute in few large steps: on CPU a 703-token prompt took 1.7x longer in 24-token
chunks, which ate what the shorter stalls saved (docs/design/scheduler-and-slo-gate.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.request import Request
from engine.step_costs import StepCosts

MARGIN_STEPS = 1.0  # decode steps kept back from a decode's slack, for estimate error
MARGIN_FRACTION = 0.25  # and this share of the chunk's own estimated cost
# Chunks may spend a decode's slack only down to this share of its TPOT SLO: the rest is for
# what the step estimate misses (a batch whose contexts grew, the router's stream). Spending it
# all, the mixed bench's summaries ended right at their SLO and a fifth of them over it.
TPOT_TARGET = 0.85
# And a prompt is held only until its first token would still come by this share of its TTFT
# SLO. Held to the SLO itself, prompts released at the last moment missed it by the few tens of
# milliseconds the estimate of their compute was short (docs/design/scheduler-and-slo-gate.md).
TTFT_TARGET = 0.85


@dataclass(frozen=True)
class RequestSLO:
    """A request's latency objectives in seconds: time to the first token (from its arrival at
    the router) and mean time per output token after it."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class PrefillGate:
    """Decides, step by step, which prompt chunks may run beside the running decodes."""

    def __init__(self, costs: StepCosts, clock: Callable[[], float] = time.time) -> None:
        self.costs = costs
        self._clock = clock  # wall clock: arrival and first-token times are time.time()
        self.num_held = 0  # chunks held back, one per step each is held

    def open(self, decodes: Sequence[Request]) -> StepWindow:
        """The window of one step whose decodes are `decodes`."""
        now = self._clock()
        step_s = self.costs.decode_step_s(max(1, len(decodes)))
        protected: list[_Protected] = []
        if step_s is not None:
            for request in decodes:
                slack = decode_slack_s(request, now, step_s)
                if slack is not None and slack < 0:  # past the target: what the SLO allows
                    slack = decode_slack_s(request, now, step_s, target=1.0)
                if slack is not None and slack >= 0:  # one past its SLO is not protected
                    num_to_come = request.params.max_tokens - request.num_output_tokens
                    protected.append(_Protected(slack, now + num_to_come * step_s))
        return StepWindow(self, now, step_s or 0.0, protected)


@dataclass
class _Protected:
    slack_s: float  # what is left of it this step
    ends_at: float  # when its last token is due, at the current step


class StepWindow:
    """The slack left in one step for prompt chunks."""

    def __init__(
        self, gate: PrefillGate, now: float, step_s: float, protected: list[_Protected]
    ) -> None:
        self._gate = gate
        self.now = now
        self.step_s = step_s
        self._protected = protected

    def admits(self, request: Request, num_new: int) -> bool:
        """Whether `num_new` prompt tokens of `request` run this step (True uses up slack).

        A chunk waits only if waiting saves a decode: some decode it does not fit ends before
        the prompt must start. When every decode it breaks would still be running then, waiting
        only moves the stall later and bunches the prompts that waited into one long step."""
        if not self._protected:
            return True
        costs = self._gate.costs
        cost_s = costs.prefill_s(num_new, request.num_computed_tokens)
        if cost_s is None:
            return True
        margin_s = MARGIN_STEPS * self.step_s + MARGIN_FRACTION * cost_s
        broken = [d for d in self._protected if d.slack_s < cost_s + margin_s]
        if broken and request.slo is not None:
            latest_start = self._latest_start(request, costs)
            if any(d.ends_at <= latest_start for d in broken):
                self._gate.num_held += 1
                return False
        for decode in self._protected:
            decode.slack_s -= cost_s
        self._protected = [d for d in self._protected if d.slack_s >= 0]
        return True

    def _latest_start(self, request: Request, costs: StepCosts) -> float:
        """When the prompt's chunks must start for its first token to come by TTFT_TARGET of
        its TTFT SLO."""
        assert request.slo is not None
        num_left = request.num_prompt_tokens - request.num_computed_tokens
        left_s = costs.prefill_s(num_left, request.num_computed_tokens) or 0.0
        deadline = request.arrival_time + TTFT_TARGET * request.slo.ttft_s
        return deadline - 2 * self.step_s - (1 + MARGIN_FRACTION) * left_s


def decode_slack_s(
    request: Request, now: float, step_s: float, target: float = TPOT_TARGET
) -> float | None:
    """How much longer the decode may be stalled before its TPOT passes `target` x its SLO
    (None: it has no SLO, or no first token yet)."""
    if request.slo is None or request.first_token_at is None:
        return None
    max_tokens = request.params.max_tokens
    deadline = request.first_token_at + target * request.slo.tpot_s * (max_tokens - 1)
    num_to_come = max(0, max_tokens - request.num_output_tokens)
    return deadline - now - num_to_come * step_s
