"""Everything that crosses a process boundary around a worker, typed: one module.

    router ──Reserve / Submit / Abort / Load / PollEvents──▶ a worker (any role)
                (Load may carry back the prefix cache's changes, for KV-aware routing)
    worker ──KVTransferDone / KVAbort (ControlMessage)─────▶ its peer worker (through Deliver)

The messages are plain, picklable dataclasses; protobuf conversion happens once, in the router.
A call is a `WorkerCall[R]` dataclass whose `run(worker)` calls the worker's own method, so the
host of a worker (a child process, a Ray actor, the test harness) forwards one object and types
hold at both ends: no method name travels as a string. `Worker` is the protocol every worker
implements (worker/instance.py, router/synthetic.py); the router's async handles
(router/worker_api.py) make the same calls.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from engine.block_pool import PrefixCacheChanges
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.slo import RequestSLO
from kv_transfer.messages import KVAbort, KVTicket, KVTransferDone

ControlMessage = KVTransferDone | KVAbort  # between the two sides of a hand-off
SendControl = Callable[[str, ControlMessage], None]  # how a worker reaches a peer, by its id

R = TypeVar("R")


class Role(str, enum.Enum):
    """What the router uses an instance for. A PREFILL instance prefills for decode instances,
    a DECODE instance decodes KV it received; a COLOCATED one runs both phases of its own
    requests. An ADAPTIVE one does all three, and the router chooses per request
    (router/adaptive/placer.py). One worker may hold both connector sides (worker/config.py)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    ADAPTIVE = "adaptive"


class PrefixReport(str, enum.Enum):
    """What a load report tells of the instance's prefix cache (router/prefix_index.py): nothing,
    its changes since the last report that told them, or all it holds."""

    NONE = "none"
    CHANGES = "changes"
    SNAPSHOT = "snapshot"


class Overloaded(Exception):
    """A worker refused work because it is full (the router answers RESOURCE_EXHAUSTED)."""


class WorkerUnavailable(Exception):
    """A worker died or does not answer (the router answers UNAVAILABLE or retries elsewhere)."""


@dataclass(frozen=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.time() when the router accepted the request
    prefill_instance: str = ""
    decode_instance: str = ""
    slo: RequestSLO | None = None  # what an SLO-scheduling engine holds its prompt chunks by


@dataclass
class RequestTimings:
    """Each stage measured once, where it happens (seconds; the router adds its own queue time
    and the transfer, from the two wall-clock stamps):

        prefill_queue_s  submit -> the first step that computed any of the prompt
        prefill_s        that step's start -> the first token
        handed_off_at    wall clock (time.time) when the prefill side started sending the KV
        landed_at        wall clock when the KV had landed on the decode side
        decode_queue_s   landed -> the start of its first decode step
        decode_s         that step's start (colocated: the first token) -> the last token
    """

    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    handed_off_at: float = 0.0
    landed_at: float = 0.0
    decode_queue_s: float = 0.0
    decode_s: float = 0.0
    num_cached_tokens: int = 0
    # speculative decoding on the decode side (on the last event): tokens proposed, accepted
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @property
    def kv_transfer_s(self) -> float:
        """Hand-off to landing: the two stamps come from two processes (on two nodes, their
        clocks agree to what NTP gives, about a millisecond); 0 when the KV did not move."""
        if not self.handed_off_at or not self.landed_at:
            return 0.0
        return max(0.0, self.landed_at - self.handed_off_at)


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None  # what went wrong, when finish_reason == "error"
    source: str = ""  # instance id that produced these tokens
    timings: RequestTimings | None = None  # on the first token event and on the last
    # On an error: the instance whose loss ended the request (the other side of a KV hand-off
    # that broke, or this one when it lost a TP rank), so the router places the request again
    # (router/recovery.py) or answers UNAVAILABLE, retryable, instead of INTERNAL.
    failed_peer: str = ""
    # With the request's logprobs: one per token_ids entry. With prompt_logprobs: on the first
    # token's event (from the prefill instance), one per prompt token, None for the first.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class LoadDetails:
    """What a load report adds beyond queue and pool sizes, for the router's placer and metrics.
    None: the instance has no such part (no speculation, no SLO gate, no KV sender or receiver)
    or has not measured it yet (a decode step)."""

    chunk_size: int = 0  # the engine's prompt chunk, which the adaptive placer predicts with
    num_prefix_hit_tokens: int = 0  # cumulative, as vLLM's prefix_cache_hits
    num_prefix_queried_tokens: int = 0  # cumulative, as vLLM's prefix_cache_queries
    num_spec_proposed_tokens: int | None = None  # cumulative, with speculative decoding
    num_spec_accepted_tokens: int | None = None
    decode_step_s: float | None = None  # the decode step the engine measures at decode_batch
    decode_batch: int | None = None
    num_held_chunks: int | None = None  # prompt chunks the SLO gate held back, cumulative
    num_transfers_in_flight: int | None = None  # KV sends not yet acknowledged
    num_receiving: int | None = None  # KV receives under way
    node: str = ""  # where the instance runs: its host, or under Ray "IP/node-id" (pdserve status)
    # A prefill instance's KV links: (rank pair, transport), e.g. ("p0.0>d1.0", "cuda-ipc")
    kv_links: tuple[tuple[str, str], ...] = ()


@dataclass
class InstanceLoad:
    instance_id: str
    role: Role
    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0  # prompt tokens queued, not yet prefilled
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    healthy: bool = True
    details: LoadDetails = field(default_factory=LoadDetails)
    prefix_cache: PrefixCacheChanges | None = None  # when the load call asked for it


class Worker(Protocol):
    """One instance's worker object: thread-safe, blocking methods (its loop thread runs them
    between steps). `submit` with a ticket prefills for the decode instance the ticket names;
    without one the request runs both phases here. `reserve` readies this instance to receive a
    prompt's KV from a prefill instance."""

    instance_id: str

    def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None: ...

    def reserve(
        self, request: WorkerRequest, prefill_instance_id: str | None, prefill_tp_size: int
    ) -> KVTicket: ...

    def abort(self, request_id: str) -> str | None: ...

    def deliver(self, message: ControlMessage) -> None: ...

    def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad: ...

    def poll_events(self, timeout_s: float) -> list[TokenEvent]: ...

    def process_ids(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class WorkerCall(Generic[R]):
    """One call on a worker, as it crosses a process boundary."""

    def run(self, worker: Worker) -> R:
        raise NotImplementedError


@dataclass(frozen=True)
class Submit(WorkerCall[None]):
    request: WorkerRequest
    ticket: KVTicket | None

    def run(self, worker: Worker) -> None:
        worker.submit(self.request, self.ticket)


@dataclass(frozen=True)
class Reserve(WorkerCall[KVTicket]):
    request: WorkerRequest
    prefill_instance_id: str | None
    prefill_tp_size: int

    def run(self, worker: Worker) -> KVTicket:
        return worker.reserve(self.request, self.prefill_instance_id, self.prefill_tp_size)


@dataclass(frozen=True)
class Abort(WorkerCall["str | None"]):
    request_id: str

    def run(self, worker: Worker) -> str | None:
        return worker.abort(self.request_id)


@dataclass(frozen=True)
class Deliver(WorkerCall[None]):
    message: ControlMessage

    def run(self, worker: Worker) -> None:
        worker.deliver(self.message)


@dataclass(frozen=True)
class Load(WorkerCall[InstanceLoad]):
    prefix: PrefixReport = PrefixReport.NONE

    def run(self, worker: Worker) -> InstanceLoad:
        return worker.load(self.prefix)


@dataclass(frozen=True)
class PollEvents(WorkerCall["list[TokenEvent]"]):
    timeout_s: float

    def run(self, worker: Worker) -> list[TokenEvent]:
        return worker.poll_events(self.timeout_s)


@dataclass(frozen=True)
class ProcessIds(WorkerCall["list[int]"]):
    def run(self, worker: Worker) -> list[int]:
        return worker.process_ids()
