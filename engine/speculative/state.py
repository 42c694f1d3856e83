"""A request's speculation: its counts (reported in timings and usage) and how many tokens to
propose next.

Adaptive length: all accepted grows k by one (up to the configured maximum); a partial accept
sets k to the accepted run plus one; none accepted halves k, and two or more misses in a row
stop proposing for 2, 4, ... up to 64 decode steps. A request with nothing to copy therefore
costs plain decodes after a few tries, and one that starts copying again is found on the next
probe. `rate` (an exponential average of accepted / proposed) is what the step's cost check
in proposer.py weighs against the price of a verified token.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 64
RATE_WEIGHT = 0.3  # of the newest verification in `rate`


@dataclass
class SpecState:
    max_tokens: int  # the configured num_tokens
    num_tokens: int = 0  # what the next proposal may hold; set from max_tokens on creation
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0
    misses: int = 0  # verifications in a row with nothing accepted
    paused_steps: int = 0  # decode steps left without proposing
    rate: float = 0.6  # expected share of proposed tokens accepted (optimistic at first)

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.max_tokens

    def wants_proposal(self) -> bool:
        """False while paused (each call while paused counts one step of the pause)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verifications += 1
        self.rate += RATE_WEIGHT * (num_accepted / num_proposed - self.rate)
        if num_accepted == num_proposed:
            self.num_tokens = min(self.num_tokens + 1, self.max_tokens)
            self.misses = 0
        elif num_accepted > 0:
            self.num_tokens = min(num_accepted + 1, self.max_tokens)
            self.misses = 0
        else:
            self.num_tokens = max(1, self.num_tokens // 2)
            self.misses += 1
            if self.misses >= 2:
                self.paused_steps = min(2 ** (self.misses - 1), MAX_PAUSE_STEPS)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0
