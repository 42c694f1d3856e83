"""Forming KV pair channels before workers take requests: at start, and after a restart.

At start the cluster sends one two-token request through every (prefill, decode) pair
(`form_all_channels`).

A worker actor that Ray restarted has fresh channel state, while its peers still hold channels
to the process that died; the first transfer over each such pair fails and makes the peers
rebuild. So the restarted actor sends two-token requests through its pairs before the router
may use it:

    restarted decode D:   from its constructor (the router cannot reach it yet): reserve here
                          -> P.submit (actor call) -> the KV lands here and D decodes one token;
                          success is D's own final event; failed pairs are retried (3 tries)
    restarted prefill P:  on a thread after its constructor (the decode side's acks arrive as
                          calls to P), reporting unhealthy until done: two rounds of D.reserve
                          -> submit here, each until no hand-off is in flight; the first round
                          makes the peers drop their stale channels, the second builds new ones

The other side's events for these requests reach the router, which drops them (unknown ids).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from deploy.runtime.ray.handles import actor_name
from engine.sampling_params import SamplingParams
from worker.protocol import PollEvents, Reserve, Role, Submit, Worker, WorkerRequest

logger = logging.getLogger(__name__)
_ATTEMPTS = 3
_PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def warmup_request(prefill_id: str, decode_id: str) -> WorkerRequest:
    request_id = f"pdserve-warmup-{prefill_id}-{decode_id}-{uuid.uuid4().hex[:6]}"
    return WorkerRequest(request_id, [1, 1], _PARAMS, time.time(), prefill_id)


def form_channels(
    worker: Any,
    role: Role,
    instance_id: str,
    tp_size: int,
    peers: dict[str, int],
    namespace: str,
    timeout_s: float,
) -> list[str]:
    """Send a request through every (this, peer) pair until it succeeds (at most 3 tries);
    returns the peers whose pair still failed."""
    failing = list(peers)
    for _ in range(_ATTEMPTS):
        if not failing:
            break
        try:
            failing = _one_round(worker, role, instance_id, tp_size, peers, failing,
                                 namespace, timeout_s)  # fmt: skip
        except Exception as exc:  # a peer that is down: the router's health covers it
            logger.warning("forming KV channels of %s failed: %r", instance_id, exc)
    return failing


def _one_round(
    worker: Worker, role: Role, instance_id: str, tp_size: int, peers: dict[str, int],
    peer_ids: list[str], namespace: str, timeout_s: float,
) -> list[str]:  # fmt: skip
    pending: dict[str, str] = {}  # request id -> peer id
    for peer_id in peer_ids:
        peer = ray.get_actor(actor_name(peer_id), namespace)
        if role == Role.DECODE:
            request = warmup_request(peer_id, instance_id)
            ticket = worker.reserve(request, peer_id, peers[peer_id])
            ray.get(peer.call.remote(Submit(request, ticket)), timeout=timeout_s)
        else:
            request = warmup_request(instance_id, peer_id)
            reserve = Reserve(request, instance_id, tp_size)
            ticket = ray.get(peer.call.remote(reserve), timeout=timeout_s)
            worker.submit(request, ticket)
        pending[request.request_id] = peer_id
    failed = _wait(worker, role, pending, timeout_s)
    return sorted({pending[request_id] for request_id in failed})


def _wait(worker: Worker, role: Role, pending: dict[str, str], timeout_s: float) -> set[str]:
    """The request ids that failed; the rest succeeded (see the module docstring)."""
    waiting, failed, started = set(pending), set(), set()
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for event in worker.poll_events(0.05):
            if event.request_id not in waiting:
                continue
            if event.token_ids:
                started.add(event.request_id)
            if event.finish_reason is not None:
                waiting.discard(event.request_id)
                if event.finish_reason == "error":
                    failed.add(event.request_id)
        settled = not worker.load().extra.get("num_transfers_in_flight")
        if role == Role.PREFILL and waiting <= started and settled:
            # a failed hand-off emits its error event before it leaves the in-flight count
            failed |= {e.request_id for e in worker.poll_events(0) if e.finish_reason == "error"}
            waiting.clear()
    return failed | waiting


def form_all_channels(
    prefill: dict[str, Any], decode: dict[str, Any], prefill_tp_size: int, timeout_s: float
) -> None:
    """At cluster start (before the router polls anyone): a two-token request through every
    (prefill, decode) pair builds each pair's channels (one per prefill rank x decode rank)
    now, not in the first user request. One request per pair, so no channel is dialed twice
    at once."""
    pending: set[str] = set()
    for prefill_id, prefill_actor in prefill.items():
        for decode_id, decode_actor in decode.items():
            request = warmup_request(prefill_id, decode_id)
            reserve = Reserve(request, prefill_id, prefill_tp_size)
            ticket = ray.get(decode_actor.call.remote(reserve), timeout=timeout_s)
            ray.get(prefill_actor.call.remote(Submit(request, ticket)), timeout=timeout_s)
            pending.add(request.request_id)
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"KV channels did not form within {timeout_s:.0f}s: {pending}")
        polls = [a.call.remote(PollEvents(0.05)) for a in [*prefill.values(), *decode.values()]]
        for event in (e for events in ray.get(polls, timeout=timeout_s) for e in events):
            if event.finish_reason == "error":
                raise RuntimeError(f"forming KV channels failed: {event.error}")
            if event.finish_reason is not None:
                pending.discard(event.request_id)


# reserve(decode peer id, request, prefill instance id, prefill TP size) -> the peer's ticket
PeerReserve = Callable[[str, WorkerRequest, str, int], Any]


def settle_prefill_channels(
    worker: Any,
    instance_id: str,
    tp_size: int,
    peers: dict[str, int],
    namespace: str,
    timeout_s: float,
    reserve: PeerReserve | None = None,
) -> None:
    """A restarted prefill instance: two rounds of a request to every decode peer, each round
    until no hand-off is in flight. The first round meets the peers' stale channels and makes
    them rebuild; the second builds the new ones. Its events go to the router, which drops them.
    `reserve` reaches a peer (default: its actor in `namespace`; the plain-process runtime
    passes its own)."""

    def reserve_on_actor(peer_id: str, request: WorkerRequest, prefill_id: str, tp: int) -> Any:
        peer = ray.get_actor(actor_name(peer_id), namespace)
        return ray.get(peer.call.remote(Reserve(request, prefill_id, tp)), timeout=timeout_s)

    reserve = reserve or reserve_on_actor
    for _ in range(2):
        for peer_id in peers:
            try:
                request = warmup_request(instance_id, peer_id)
                worker.submit(request, reserve(peer_id, request, instance_id, tp_size))
            except Exception as exc:  # a peer that is down: the router's health covers it
                logger.warning("forming KV channels %s -> %s: %r", instance_id, peer_id, exc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = worker.load()
            if (
                not load.num_waiting_requests
                and not load.num_running
                and not load.extra.get("num_transfers_in_flight")
            ):
                break
            time.sleep(0.02)
