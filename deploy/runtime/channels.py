"""Forming KV pair channels before workers take requests: at start, and after a restart.

At start the Ray cluster sends one two-token request through every (prefill, decode) pair
(`form_all_channels`); an adaptive instance is both sides of its pairs.

A worker that was restarted has fresh channel state, while its peers still hold channels to the
process that died; the first transfer over each such pair fails and makes the peers rebuild. So
the restarted worker sends two-token requests through its pairs before the router may use it:

    restarted decode D:   from its actor's constructor (the router cannot reach it yet): reserve
                          here -> P.submit -> the KV lands here and D decodes one token; success
                          is D's own final event; failed pairs are retried (3 tries)
    restarted prefill P:  (on a thread after its actor's constructor under Ray: the decode side's
                          acks arrive as calls to P), reported unhealthy until done: two rounds of
                          D.reserve -> submit here, each until no hand-off is in flight; the first
                          round makes the peers drop their stale channels, the second builds new ones
    restarted adaptive A: both, the decode side first

Peers are reached through a `PeerCall`: an actor call under Ray (deploy/runtime/ray/handles.py),
a pipe call in plain processes (deploy/runtime/local/local_cluster.py). The other side's events
for these requests reach the router, which drops them (unknown ids).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.sampling_params import SamplingParams
from worker.protocol import Load, PollEvents, Reserve, Submit, Worker, WorkerCall, WorkerRequest

logger = logging.getLogger(__name__)
_ATTEMPTS = 3
_PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)

# call(instance id, typed call) -> its result, waited for (with the caller's timeout)
PeerCall = Callable[[str, WorkerCall[Any]], Any]


def warmup_request(prefill_id: str, decode_id: str) -> WorkerRequest:
    request_id = f"pdserve-warmup-{prefill_id}-{decode_id}-{uuid.uuid4().hex[:6]}"
    return WorkerRequest(request_id, [1, 1], _PARAMS, time.time(), prefill_id)


def form_decode_channels(
    worker: Worker, instance_id: str, peers: dict[str, int], call: PeerCall, timeout_s: float
) -> list[str]:
    """A restarted decode instance: a request from every prefill peer (id -> its TP size) until
    it succeeds (at most 3 tries); returns the peers whose pair still failed."""
    failing = list(peers)
    for _ in range(_ATTEMPTS):
        if not failing:
            break
        try:
            pending: dict[str, str] = {}  # request id -> peer id
            for peer_id in failing:
                request = warmup_request(peer_id, instance_id)
                ticket = worker.reserve(request, peer_id, peers[peer_id])
                call(peer_id, Submit(request, ticket))
                pending[request.request_id] = peer_id
            failing = sorted({pending[i] for i in _failed(worker, set(pending), timeout_s)})
        except Exception as exc:  # a peer that is down: the router's health covers it
            logger.warning("forming KV channels of %s failed: %r", instance_id, exc)
    return failing


def _failed(worker: Worker, waiting: set[str], timeout_s: float) -> set[str]:
    """Of the `waiting` request ids, those that ended in an error or did not end in time."""
    failed = set()
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for event in worker.poll_events(0.05):
            if event.request_id in waiting and event.finish_reason is not None:
                waiting.discard(event.request_id)
                if event.finish_reason == "error":
                    failed.add(event.request_id)
    return failed | waiting


def form_all_channels(
    pairs: list[tuple[str, str]],
    prefill_tp_sizes: dict[str, int],
    call: PeerCall,
    timeout_s: float,
) -> None:
    """At cluster start (before the router polls anyone): a two-token request through every
    (prefill, decode) pair (ClusterSpec.kv_pairs: adaptive instances pair with every other one)
    builds each pair's channels (one per prefill rank x decode rank) now, not in the first user
    request. One request per pair, so no channel is dialed twice at once."""
    pending: set[str] = set()
    for prefill_id, decode_id in pairs:
        request = warmup_request(prefill_id, decode_id)
        ticket = call(decode_id, Reserve(request, prefill_id, prefill_tp_sizes[prefill_id]))
        call(prefill_id, Submit(request, ticket))
        pending.add(request.request_id)
    instance_ids = sorted({instance_id for pair in pairs for instance_id in pair})
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"KV channels did not form within {timeout_s:.0f}s: {pending}")
        for instance_id in instance_ids:
            for event in call(instance_id, PollEvents(0.02)):
                if event.finish_reason == "error":
                    raise RuntimeError(f"forming KV channels failed: {event.error}")
                if event.finish_reason is not None:
                    pending.discard(event.request_id)


def settle_prefill_channels(
    here: Callable[[WorkerCall[Any]], Any],
    instance_id: str,
    tp_size: int,
    peer_ids: list[str],
    call: PeerCall,
    timeout_s: float,
) -> None:
    """A restarted prefill instance (`here` runs a call on it): two rounds of a request to every
    decode peer, each round until no hand-off is in flight. The first round meets the peers'
    stale channels and makes them rebuild; the second builds the new ones. Its events go to the
    router, which drops them."""
    for _ in range(2):
        for peer_id in peer_ids:
            try:
                request = warmup_request(instance_id, peer_id)
                here(Submit(request, call(peer_id, Reserve(request, instance_id, tp_size))))
            except Exception as exc:  # a peer that is down: the router's health covers it
                logger.warning("forming KV channels %s -> %s: %r", instance_id, peer_id, exc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = here(Load())
            if (
                not load.num_waiting_requests
                and not load.num_running
                and not load.details.num_transfers_in_flight
            ):
                break
            time.sleep(0.02)
