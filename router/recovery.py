"""What a request does when an instance it runs on is lost: it is placed again.

    before its first token   retry: the same request, on instances that did not fail it
    after its first token    migrate: the prompt plus every token the client already has,
                             prefilled on another instance, which goes on from the next token

Only losses are recovered: an instance that went away (its calls fail, it stops answering, it
reports itself unhealthy) or a KV hand-off whose other side did (`failed_peer`). Both are
UNAVAILABLE failures with a `lost_instance`. A request that makes a worker fail by itself
(INTERNAL) is not tried again: it could take every instance down in turn.

A migrated greedy stream is token for token the undisturbed one: the next token is the argmax
over the same context, prefilled instead of decoded (the parity tests hold both to
transformers). A seeded sampled stream goes on with valid samples, but not the same ones: the
new instance's generator starts from the seed again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from router.generation_errors import FailureKind, GenerationFailed
from router.validation import ValidatedRequest


@dataclass
class Recovery:
    """One request's recoveries: how many it may still make, and what they cost it."""

    max_retries: int
    deadline_at: float | None  # time.monotonic() at which the client stops waiting
    retries: int = 0
    migrations: int = 0
    recovery_s: float = 0.0
    failed_at: float | None = None  # the loss being recovered from, until the next token

    def take(self, failure: GenerationFailed, num_tokens_sent: int) -> None:
        """Count a recovery from `failure`, or raise what the client gets instead."""
        recoverable = failure.kind is FailureKind.UNAVAILABLE and failure.lost_instance
        if not recoverable or self.max_retries == 0:
            raise failure
        if self.retries + self.migrations >= self.max_retries:
            raise GenerationFailed(
                FailureKind.UNAVAILABLE,
                f"{failure} (gave up after {self.max_retries} recoveries)",
                failure.lost_instance,
            ) from failure
        if self.deadline_passed():
            raise failure
        if num_tokens_sent:
            self.migrations += 1
            if self.failed_at is None:  # lost again while recovering: down since the first
                self.failed_at = time.monotonic()
        else:  # the time a retry costs shows as the later start of the placement that answered
            self.retries += 1

    def resumed(self) -> None:
        """A token of the new placement arrived: a migrated stream is back."""
        if self.failed_at is not None:
            self.recovery_s += time.monotonic() - self.failed_at
            self.failed_at = None

    def deadline_passed(self) -> bool:
        return self.deadline_at is not None and time.monotonic() >= self.deadline_at

    def wait_until(self, wait_s: float) -> float:
        """How long (time.monotonic()) the next dispatch may wait for an instance to return."""
        until = time.monotonic() + wait_s
        return until if self.deadline_at is None else min(until, self.deadline_at)


def continuation(request: ValidatedRequest, sent_token_ids: list[int]) -> ValidatedRequest:
    """The request that goes on after `sent_token_ids`: they join the prompt, and the budget
    shrinks by as many. Some budget is always left: a worker sends the last token and its
    finish reason in one event, so a stream that got its last token has finished.
    min_tokens shrinks too, and the prompt's log-probabilities, already sent, are not asked
    again; the frequency and presence penalties still count the sent tokens as output."""
    if not sent_token_ids:
        return request
    num_sent = len(sent_token_ids)
    params = dataclasses.replace(
        request.params,
        max_tokens=request.params.max_tokens - num_sent,
        min_tokens=max(0, request.params.min_tokens - num_sent),
        prior_output_tokens=request.params.prior_output_tokens + num_sent,
        prompt_logprobs=None,
    )
    prompt = [*request.prompt_token_ids, *sent_token_ids]
    return dataclasses.replace(request, prompt_token_ids=prompt, params=params)
