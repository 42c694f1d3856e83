"""One streaming request's state in the router, and which of its channel's items still count.

GenerationRunner (router/generation.py) keeps one `Progress` per request: what the client has
been sent (tokens, text state, timings) and the current placement (its instances and where its
events are). A placement starts anew on each retry or migration (router/recovery.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.adaptive import Placement
from router.detokenizer import IncrementalDetokenizer
from router.dispatch import Dispatch
from router.recovery import Recovery
from router.stop_strings import StopStringMatcher
from router.worker_api import RequestTimings, TokenEvent
from router.worker_pool import InstanceLost, RequestChannel


@dataclass
class Progress:
    """The mutable state of one streaming request."""

    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    recovery: Recovery
    accepted_at: float  # perf_counter
    dispatched_at: float = 0.0  # its first placement
    first_token_at: float | None = None
    last_token_at: float = 0.0
    sent_token_ids: list[int] = field(default_factory=list)  # every token the client got
    worker_timings: RequestTimings = field(default_factory=RequestTimings)
    # The current placement:
    placed_at: float = 0.0
    prefill_instance: str = ""
    decode_instance: str = ""
    prefilled: bool = False  # its prefill's first event is in
    early_events: list[TokenEvent] = field(default_factory=list)  # decode before that
    finished_by: str | None = None  # instance whose finish event ended the placement
    decode_started: bool = False  # an event from the decode instance: the KV has landed
    first_placed_at: float = 0.0  # the placement that sent the client's first token
    placement: Placement | None = None  # the current placement's adaptive decision

    def start_placement(self, dispatch: Dispatch) -> None:
        self.placed_at = time.perf_counter()
        self.prefill_instance = dispatch.prefill_id
        self.decode_instance = dispatch.decode_id or ""
        self.placement = dispatch.placement
        self.prefilled = self.decode_started = False
        self.early_events.clear()
        self.finished_by = None
        if self.first_token_at is None:  # a retry: only the placement that answers counts
            self.worker_timings = RequestTimings()

    def through_stop(self, token_ids: list[int], num_after: int) -> list[int]:
        """An event's tokens up to the one a stop string ends in (`num_after`: the characters
        fed after its end): the text ends there, and so do the token ids and logprobs the
        client gets, and the completion's token count."""
        num_earlier = len(self.detokenizer.token_ids) - len(token_ids)
        through = self.detokenizer.num_ids_through(self.detokenizer.num_chars - num_after)
        kept = token_ids[: max(through - num_earlier, 0)]
        del self.sent_token_ids[len(self.sent_token_ids) - len(token_ids) + len(kept) :]
        return kept


def is_stale(item: TokenEvent | InstanceLost, channel: RequestChannel, progress: Progress) -> bool:
    """An item the request must ignore: the loss of an instance it no longer depends on, an
    event of an abandoned placement or from an instance it was not placed on, or an error from
    an instance it no longer depends on (a prefill that failed after the decode instance took
    over: the KV has landed there)."""
    if item.request_id != channel.request_id:
        return True  # queued before the dispatcher gave up on that placement
    if isinstance(item, InstanceLost):
        return item.instance_id not in channel.holder_ids
    if not item.source:
        return False  # a worker that does not say who it is (tests' in-process handles)
    if item.source not in (progress.prefill_instance, progress.decode_instance):
        return True
    return item.finish_reason == "error" and item.source not in channel.holder_ids
