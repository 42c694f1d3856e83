"""A request's timings as the client gets them: the workers' stages, the router's, recovery's.

The stages (router_queue_s + prefill_queue_s + prefill_s + kv_transfer_s + decode_queue_s +
decode_s, plus recovery_s when an instance was lost) add up to e2e_s, less the call hops. Each
is measured once, where it happens: the workers report theirs (RequestTimings), the router its
queue and the client-side latencies. See the proto's Timings for what each means after a retry
or a migration.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.worker_api import RequestTimings


@dataclass(frozen=True)
class RouterTimings:
    router_queue_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    per_token_s: float = 0.0
    e2e_s: float = 0.0
    retries: int = 0
    migrations: int = 0
    recovery_s: float = 0.0


@dataclass(frozen=True)
class RouterClock:
    """The router's own instants (time.perf_counter()) for one request."""

    accepted_at: float
    dispatched_at: float  # its first placement
    first_token_at: float
    last_token_at: float
    num_output_tokens: int


def request_timings(
    clock: RouterClock,
    worker: RequestTimings,
    retries: int = 0,
    migrations: int = 0,
    recovery_s: float = 0.0,
) -> RouterTimings:
    """`worker`: the stages of the placement that sent the first token (retries: the last one).
    `recovery_s`: the time lost to failures, before that placement and after its loss."""
    num_after_first = clock.num_output_tokens - 1
    per_token_s = (
        (clock.last_token_at - clock.first_token_at) / num_after_first
        if num_after_first > 0
        else 0.0
    )
    router_queue_s = clock.dispatched_at - clock.accepted_at
    e2e_s = clock.last_token_at - clock.accepted_at
    decode_s = worker.decode_s
    if migrations:  # the first placement's decode ended with its loss: the rest is decoding
        before_decode = worker.prefill_queue_s + worker.prefill_s + worker.kv_transfer_s
        before_decode += router_queue_s + worker.decode_queue_s + recovery_s
        decode_s = max(0.0, e2e_s - before_decode)
    return RouterTimings(
        router_queue_s=router_queue_s,
        prefill_queue_s=worker.prefill_queue_s,
        prefill_s=worker.prefill_s,
        kv_transfer_s=worker.kv_transfer_s,
        decode_queue_s=worker.decode_queue_s,
        decode_s=decode_s,
        first_token_s=clock.first_token_at - clock.accepted_at,
        per_token_s=per_token_s,
        e2e_s=e2e_s,
        retries=retries,
        migrations=migrations,
        recovery_s=recovery_s,
    )


def merge_timings(merged: RequestTimings, update: RequestTimings) -> None:
    """Prefill fields come with the first token, decode fields with the last: keep each set one."""
    names = ("prefill_queue_s", "prefill_s", "handed_off_at", "landed_at", "decode_queue_s")
    for name in (*names, "decode_s"):
        value = getattr(update, name)
        if value:
            setattr(merged, name, value)
    if update.num_cached_tokens:
        merged.num_cached_tokens = update.num_cached_tokens
    # each decode instance's last event counts its own part (a migrated stream has several)
    merged.num_spec_proposed_tokens += update.num_spec_proposed_tokens
    merged.num_spec_accepted_tokens += update.num_spec_accepted_tokens
