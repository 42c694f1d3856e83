"""A request's clocks inside one worker, and the timings its events carry (worker/instance.py
stamps them; worker/protocol.RequestTimings is what the router gets)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine.outputs import StepOutput
from engine.request import Request
from worker.protocol import RequestTimings


@dataclass
class TrackedRequest:
    """A request's clocks (time.perf_counter) from its start here to its last event."""

    start: float  # submit; for a request whose KV came from elsewhere, when the KV landed
    landed_at_wall: float = 0.0  # received: time.time() when the KV landed
    started_at: float | None = None  # the first step that computed it (prompt, or decode)
    decode_from: float = 0.0  # received: its first decode step's start; else its first token
    timings: RequestTimings | None = None  # set with its first token
    error: str | None = None  # why it ended before its first token, when not a plain abort
    num_cached_tokens: int = 0
    # The engine's request, submitted here: a prompt handed off in its first step has left the
    # scheduler by the time the step's end is seen, and its cache hits are read from it.
    request: Request | None = None

    def timings_for(self, output: StepOutput, now: float) -> RequestTimings | None:
        """What the output's event carries: the stages so far on its first token, and on its
        last event the decode time too (handed off: the first token's timings are the last)."""
        started_at = self.started_at if self.started_at is not None else now
        first = None
        if self.timings is None and output.new_token_ids:
            if self.landed_at_wall:
                # KV that lands in a step's start hook is decoded in that same step: its queue
                # is empty, not the few hundred microseconds before the landing (negative).
                started_at = max(started_at, self.start)
                self.decode_from = started_at
                first = RequestTimings(
                    landed_at=self.landed_at_wall, decode_queue_s=started_at - self.start
                )
            else:
                self.decode_from = now
                first = RequestTimings(
                    prefill_queue_s=started_at - self.start,
                    prefill_s=now - started_at,
                    num_cached_tokens=self.num_cached_tokens,
                )
            if output.handed_off:
                first.handed_off_at = time.time()
            self.timings = first
        if not output.finished or output.handed_off:
            return first
        if self.timings is None:  # ended before any token
            return RequestTimings(prefill_queue_s=started_at - self.start)
        return replace(
            self.timings,
            decode_s=now - self.decode_from,
            num_spec_proposed_tokens=output.num_spec_proposed,
            num_spec_accepted_tokens=output.num_spec_accepted,
        )
