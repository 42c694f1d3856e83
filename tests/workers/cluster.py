"""A disaggregated cluster in real processes for tests: workers, a control plane, and a relay.

    test process                                           worker processes (ProcessWorker)
    Relay: reserve on a decode (round robin) ──────────▶   Worker, role DECODE  (TP=1)
           submit to the prefill with the ticket ──────▶   Worker, role PREFILL (TP=k, spawns ranks)
           poll_events on every worker ◀──────────────     TokenEvents
    ControlForwarder ◀── one queue ── send_control(instance_id, message) in every worker
                     ──▶ registry[instance_id].call(Deliver(message))

The relay does what the router will; the forwarder does what deploy/ will (Ray calls there).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deploy.runtime.local.control_relay import ControlRelay
from deploy.runtime.local.process_host import ProcessWorker
from engine.sampling_params import SamplingParams
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import (
    Abort,
    Load,
    Overloaded,
    PollEvents,
    ProcessIds,
    Reserve,
    Submit,
    TokenEvent,
    WorkerRequest,
    WorkerUnavailable,
)

CALL_TIMEOUT_S = 30.0


class Cluster:
    """Worker processes by instance id, and the thread that carries their control messages."""

    def __init__(self) -> None:
        self.workers: dict[str, ProcessWorker] = {}
        self.process_ids: list[int] = []
        self.relay = ControlRelay(self.workers, call_timeout_s=10.0)

    def start(self, specs: Iterable[tuple[str, WorkerConfig]]) -> None:
        """Start workers concurrently (process start-up dominates the tests' time)."""
        specs = list(specs)
        with ThreadPoolExecutor(len(specs)) as pool:
            started = pool.map(lambda spec: (spec[0], self._start_one(*spec)), specs)
            for instance_id, worker in started:
                self.workers[instance_id] = worker
                self.process_ids.extend(worker.call(ProcessIds()))

    def _start_one(self, instance_id: str, config: WorkerConfig) -> ProcessWorker:
        factory = Worker
        control = self.relay.sender()
        return ProcessWorker(factory, config, instance_id, control, name=instance_id)

    def stop_worker(self, instance_id: str) -> None:
        worker = self.workers.pop(instance_id, None)
        if worker is not None:
            worker.shutdown()

    def shutdown(self) -> None:
        instance_ids = list(self.workers)
        if instance_ids:  # concurrently: each waits for its loop, its ranks and its process
            with ThreadPoolExecutor(len(instance_ids)) as pool:
                list(pool.map(self.stop_worker, instance_ids))
        self.relay.stop()


def process_is_running(pid: int) -> bool:
    """True unless the process is gone or a zombie (nobody may reap orphans in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@dataclass
class Result:
    """One request's tokens as the relay assembled them.

    The prefill's first-token event and the decode's first event race through different
    processes, so the first token is kept apart and always goes first (the router must do the
    same: decode tokens follow the prefill's first token whatever order they arrive in).
    """

    first_token_ids: list[int] = field(default_factory=list)  # from the prefill instance
    decode_token_ids: list[int] = field(default_factory=list)
    decode_sources: list[str] = field(default_factory=list)  # instance id of each decode token
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # what the prefill's first event says its prefix cache held

    @property
    def token_ids(self) -> list[int]:
        return self.first_token_ids + self.decode_token_ids

    @property
    def done(self) -> bool:
        """Ended, and every token is in (a decode's last event may beat the first token)."""
        return self.finish_reason is not None and (
            bool(self.first_token_ids) or self.finish_reason in ("abort", "error")
        )


class Relay:
    """Does what the router will: reserve on a decode instance (round robin over `decode_ids`),
    submit to the prefill instance with the ticket, collect events from both until each request
    ends, and abort the decode reservation of a request that ended at its first token."""

    def __init__(
        self, cluster: Cluster, prefill_id: str, decode_ids: list[str], prefill_tp_size: int
    ) -> None:
        self.cluster = cluster
        self.prefill_id = prefill_id
        self.decode_ids = decode_ids
        self.prefill_tp_size = prefill_tp_size
        self._next_decode = itertools.cycle(decode_ids)
        self.decode_of: dict[str, str] = {}
        self.results: dict[str, Result] = {}

    def worker(self, instance_id: str) -> ProcessWorker:
        return self.cluster.workers[instance_id]

    def dispatch(self, request: WorkerRequest) -> bool:
        """Reserve and submit; False if every decode instance is full (retry later)."""
        for _ in self.decode_ids:
            decode_id = next(self._next_decode)
            try:
                reserve = Reserve(request, self.prefill_id, self.prefill_tp_size)
                ticket = self.worker(decode_id).call(reserve)
            except Overloaded:
                continue
            self.expect(request.request_id, decode_id)
            self.worker(self.prefill_id).call(Submit(request, ticket))
            return True
        return False

    def expect(self, request_id: str, decode_id: str) -> None:
        """Track a request dispatched by hand (tests that step through the stages themselves)."""
        self.decode_of[request_id] = decode_id
        self.results[request_id] = Result()

    def poll(
        self, instance_ids: list[str] | None = None, timeout_s: float = 0.02
    ) -> list[TokenEvent]:
        """One round of event polls (default: the prefill and every decode instance)."""
        events: list[TokenEvent] = []
        for instance_id in instance_ids or [self.prefill_id, *self.decode_ids]:
            batch = self.worker(instance_id).call(PollEvents(timeout_s))
            events.extend(batch)
            for event in batch:
                self._record(event)
        return events

    def _record(self, event: TokenEvent) -> None:
        result = self.results.get(event.request_id)
        if result is None or result.done:
            return  # ended already (a late report from the other side)
        if event.source == self.prefill_id:
            result.first_token_ids.extend(event.token_ids)
            if event.timings is not None and event.token_ids:
                result.num_cached_tokens = event.timings.num_cached_tokens
        else:
            result.decode_token_ids.extend(event.token_ids)
            result.decode_sources.extend([event.source] * len(event.token_ids))
        if event.finish_reason is not None and result.finish_reason is None:
            result.finish_reason = event.finish_reason
            result.error = event.error
            if event.source == self.prefill_id:  # the decode side may still hold a reservation
                decode = self.cluster.workers.get(self.decode_of[event.request_id])
                try:
                    if decode is not None:
                        decode.call(Abort(event.request_id))
                except WorkerUnavailable:
                    pass  # a dead decode instance holds nothing any more

    def run(
        self,
        requests: list[WorkerRequest],
        timeout_s: float = 60.0,
        on_poll: Callable[[list[TokenEvent]], None] | None = None,
    ) -> dict[str, Result]:
        """Dispatch every request (retrying while decode instances are full) and wait for all."""
        pending = list(requests)
        deadline = time.monotonic() + timeout_s
        ids = [request.request_id for request in requests]
        while pending or any(not self.results[i].done for i in ids):
            assert time.monotonic() < deadline, f"requests still running: {self.unfinished(ids)}"
            while pending and self.dispatch(pending[0]):
                pending.pop(0)
            events = self.poll()
            if on_poll is not None:
                on_poll(events)
        return {i: self.results[i] for i in ids}

    def unfinished(self, ids: list[str]) -> list[str]:
        return [i for i in ids if i not in self.results or not self.results[i].done]


def make_requests(
    prompts: list[list[int]], params: SamplingParams | list[SamplingParams], prefix: str
) -> list[WorkerRequest]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    return [
        WorkerRequest(f"{prefix}-{i}", prompt, p, time.time())
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True))
    ]


def wait_for_event(
    relay: Relay,
    instance_id: str,
    condition: Callable[[Result], bool],
    request_id: str,
    timeout_s: float = 20.0,
) -> Result:
    """Poll `instance_id`'s events until `condition(result of request_id)` holds."""
    result = relay.results[request_id]

    def holds() -> bool:
        relay.poll([instance_id], 0.05)
        return condition(result)

    wait_for(holds, timeout_s, f"{request_id} on {instance_id}")
    return result


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `condition()`; returns the seconds it took, fails the test after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.02)
    return time.monotonic() - start


def free_blocks(cluster: Cluster, instance_id: str) -> int:
    return cluster.workers[instance_id].call(Load()).num_free_blocks
