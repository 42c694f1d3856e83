"""The prefill instance: prompts in, first tokens out, KV handed off to the decode instances.

One instance is a TP group; this object lives in the driver process (rank 0) and the Executor
spawns ranks 1..k-1. The engine's Scheduler gives chunked prefill (SARATHI) under the token
budget and the prefix cache; every request runs there with max_tokens=1, so it ends at its first
token, while the real SamplingParams stay here to decide whether the request goes on to decode.

One request:

    submit(request, ticket) ─▶ queued ─▶ prefill chunks ─▶ first token sampled
        ├─ it ends there (EOS, stop id, max_tokens=1, model length): final TokenEvent, and a
        │  CANCELLED header tells the decode ranks to free the reservation
        └─ otherwise: KVSender.start (its own reference on the blocks) BEFORE scheduler.update
           frees them, every rank starts its send, the first token goes out at once (TTFT);
           the blocks are released when the decode side acks (KVTransferDone) or the deadline
           passes (a dead decode instance); they stay in the prefix cache afterwards.

What the prefill side reports: the first token (final if the request ends there), or the end
(abort / error) of a request that never got one, or an error when the hand-off fails on this
side. Aborts after the first token are silent: the decode side reports the end.

Control messages from decode instances arrive through `deliver`; messages to them (KVAbort) go
through the injected `send_control(decode_instance_id, message)`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.batch import ScheduledBatch
from engine.executor import Executor
from engine.llm import LLMEngine
from engine.messages import (
    InstanceLoad,
    Overloaded,
    RequestTimings,
    Role,
    TokenEvent,
    WorkerRequest,
)
from engine.outputs import StepOutput
from engine.ranks import RankLauncher
from engine.request import Request
from engine.worker_loop import WorkerLoop
from kv_transfer.messages import KVAbort, KVTicket, KVTransferDone
from kv_transfer.sender import KVSender
from prefill_worker.config import PrefillConfig
from prefill_worker.rank import PrefillRank, SendReport

SendControl = Callable[[str, Any], None]
_MAX_REMEMBERED_CANCELS = 65536  # a few MB; a transfer is cancelled within seconds of its ticket


@dataclass
class _Prefill:
    """A request this instance holds: queued or prefilling, then (after its first token) sending."""

    request: WorkerRequest
    ticket: KVTicket
    engine_request: Request
    submitted_at: float  # time.perf_counter()
    scheduled_at: float | None = None
    quiet: bool = False  # a failed hand-off is reported by someone else (abort, decode side)
    send_error: str | None = None  # the first rank's send failure, for the error event
    error: str | None = None  # why it ended before its first token, when not a plain abort


class PrefillWorker(WorkerLoop):
    """`submit`, `abort`, `deliver`, `load`, `poll_events`, `shutdown`; thread-safe."""

    role = Role.PREFILL

    def __init__(
        self,
        config: PrefillConfig,
        instance_id: str,
        send_control: SendControl | None = None,
        start: bool = True,
        launcher: RankLauncher | None = None,
    ) -> None:
        super().__init__(instance_id)
        self.config = config
        self.tp_size = config.engine.tensor_parallel_size
        executor = Executor(config.engine, rank_extension=PrefillRank, launcher=launcher)
        self.engine = LLMEngine(config.engine, executor)
        self.kv_sender = KVSender(self.engine.block_pool, self.tp_size, self._on_released)
        self._send_control = send_control
        self._prefills: dict[str, _Prefill] = {}
        # Transfers this instance cancelled (each gets one CANCELLED header, never two: a second
        # one would wait on the channel for a receive that is gone and break it), oldest first.
        self._cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._num_cancel_reports_due = 0
        if start:
            self.start()

    # ----------------------------------------------------------- public API
    def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        """Queue the prompt; its KV goes where `ticket` (from the decode instance) says.
        Raises Overloaded past `max_queued_tokens`, ValueError for a request that cannot run;
        either way the ticket's reservation is cancelled on the decode side."""
        self.call(lambda: self._submit(request, ticket))

    def abort(self, request_id: str) -> str | None:
        """Drop the request in any stage; a no-op if this instance holds nothing for it.
        Returns the stage it was in: "queued", "prefilling", "sending" (or None)."""
        return self.call(lambda: self._abort(request_id))

    def deliver(self, message: KVTransferDone | KVAbort) -> None:
        """A control message from a decode instance."""
        self.call(lambda: self._deliver(message))

    def load(self) -> InstanceLoad:
        return self.call(self._load)

    def process_ids(self) -> list[int]:
        """This process and the TP ranks it spawned (tests check they are all gone at the end)."""
        return [os.getpid(), *self.engine.executor.worker_pids]

    def shutdown(self) -> None:
        self.stop()
        try:  # drop every rank's KV channels first, so that no peer waits on them
            self.engine.executor.collective_call("close")
        except RuntimeError:
            pass  # a rank died: the executor's shutdown below still reaps the rest
        self.engine.shutdown()

    # ----------------------------------------------------------- commands
    def _submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        self._check_ticket(request, ticket)
        assert ticket is not None
        if (ticket.request_id, ticket.transfer_id) in self._cancelled:
            raise ValueError(
                f"the decode side already aborted the transfer of {request.request_id!r}: "
                "reserve again"
            )
        if request.request_id in self._prefills:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        try:
            num_queued = self.engine.stats.num_queued_prompt_tokens
            if num_queued + len(request.prompt_token_ids) > self.config.max_queued_tokens:
                raise Overloaded(
                    f"{self.instance_id} has {num_queued} prompt tokens queued "
                    f"(max_queued_tokens={self.config.max_queued_tokens}); retry later"
                )
            engine_request = self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                replace(request.params, max_tokens=1),  # the decode instance does the rest
                request.arrival_time,
            )
        except (Overloaded, ValueError):
            self._cancel_ticket(ticket)
            raise
        self._prefills[request.request_id] = _Prefill(
            request, ticket, engine_request, time.perf_counter()
        )

    def _check_ticket(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        if not isinstance(ticket, KVTicket):
            raise ValueError(
                f"{self.instance_id} is a prefill instance: submit needs the KVTicket that a "
                f"decode instance's reserve returned, got {type(ticket).__name__}"
            )
        block_size = self.engine.executor.block_size
        num_blocks = -(-len(request.prompt_token_ids) // block_size)
        problems = {
            "request_id": (ticket.request_id, request.request_id),
            "prefill_instance_id": (ticket.prefill_instance_id, self.instance_id),
            "prefill_tp_size": (ticket.prefill_tp_size, self.tp_size),
            "num_tokens": (ticket.num_tokens, len(request.prompt_token_ids)),
            f"number of blocks (block_size {block_size})": (len(ticket.block_ids), num_blocks),
        }
        for what, (got, expected) in problems.items():
            if got != expected:
                raise ValueError(
                    f"the ticket for {request.request_id!r} has {what} {got!r}, but this prefill "
                    f"instance needs {expected!r}: reserve with this request and instance (and "
                    "use the same block_size on prefill and decode instances)"
                )

    def _abort(self, request_id: str) -> str | None:
        entry = self._prefills.get(request_id)
        if entry is None:
            return None
        entry.quiet = True
        started = entry.engine_request.num_computed_tokens > 0
        if self.engine.abort(request_id):  # queued or prefilling: its end comes with the next step
            self._cancel_ticket(entry.ticket)
            return "prefilling" if started else "queued"
        message = self.kv_sender.abort(request_id, "the request was aborted")
        if message is not None:
            self._tell_decode(entry.ticket, message)
        return "sending"

    def _deliver(self, message: KVTransferDone | KVAbort) -> None:
        entry = self._prefills.get(message.request_id)
        if entry is None and isinstance(message, KVAbort) and message.ticket is not None:
            # Never submitted here (or long gone): end the decode ranks' receives anyway, and
            # refuse the submit if it comes after all.
            self._cancel_ticket(message.ticket)
            return
        if entry is None or entry.ticket.transfer_id != message.transfer_id:
            return  # already settled: late messages are harmless
        if isinstance(message, KVTransferDone):
            entry.quiet = entry.quiet or not message.success  # the decode side reports it
            self.kv_sender.on_done(message)
            return
        if not isinstance(message, KVAbort):
            raise TypeError(f"unexpected control message {type(message).__name__}")
        entry.quiet = True
        if self.kv_sender.on_abort(message):
            return  # every message was posted at start: the rank sends end on their own
        # Not sent yet: the decode side dropped the reservation, so the prompt is wasted work.
        entry.error = (
            f"decode instance {entry.ticket.decode_instance_id} dropped the KV reservation: "
            f"{message.reason}"
        )
        self.engine.abort(message.request_id)
        self._cancel_ticket(entry.ticket)

    def _load(self) -> InstanceLoad:
        return InstanceLoad.from_stats(
            self.instance_id,
            Role.PREFILL,
            self.engine.stats,
            self.healthy,
            num_transfers_in_flight=self.kv_sender.num_in_flight,
        )

    # --------------------------------------------------------------- the step
    def step(self) -> bool:
        progressed = self._poll_transfers()
        scheduler = self.engine.scheduler
        if not scheduler.has_unfinished():
            return progressed
        batch = scheduler.schedule()
        sampled: list[int] = []
        if batch:
            now = time.perf_counter()
            for chunk in batch.chunks:
                entry = self._prefills[chunk.request_id]
                entry.scheduled_at = entry.scheduled_at or now
            logits = self.engine.executor.execute(batch)  # [batch.num_sampled, vocab_size]
            if batch.num_sampled:
                sampled = self.engine.sampler(logits, scheduler.sampling_rows(batch))
        first_tokens = self._hand_off(batch, sampled)  # before update frees the blocks
        outputs = scheduler.update(batch, sampled)
        self._emit([self._to_event(output, first_tokens) for output in outputs])
        return bool(batch) or bool(outputs) or progressed

    def _hand_off(
        self, batch: ScheduledBatch, sampled: list[int]
    ) -> dict[str, tuple[int, str | None]]:
        """request_id -> (first token, finish reason or None) for every chunk that sampled."""
        results: dict[str, tuple[int, str | None]] = {}
        sampled_ids = iter(sampled)
        for chunk in batch.chunks:
            if not chunk.sample:
                continue
            token_id = next(sampled_ids)
            entry = self._prefills[chunk.request_id]
            reason = self._finish_reason(entry, token_id)
            if reason is None:
                block_ids = chunk.block_table[: len(entry.ticket.block_ids)]
                self.kv_sender.start(entry.ticket, block_ids)
                self.engine.executor.collective_call(
                    "start_send", entry.ticket, block_ids, token_id
                )
            else:
                self._cancel_ticket(entry.ticket)
            results[chunk.request_id] = (token_id, reason)
        return results

    def _finish_reason(self, entry: _Prefill, token_id: int) -> str | None:
        """Whether the request ends at its first token, with the request's real parameters."""
        params = entry.request.params
        eos_token_ids = self.engine.scheduler.eos_token_ids
        if (not params.ignore_eos and token_id in eos_token_ids) or (
            token_id in params.stop_token_ids
        ):
            return "stop"
        if params.max_tokens == 1 or len(entry.request.prompt_token_ids) + 1 >= (
            self.engine.max_model_len
        ):
            return "length"
        return None

    def _to_event(
        self, output: StepOutput, first_tokens: dict[str, tuple[int, str | None]]
    ) -> TokenEvent:
        request_id = output.request_id
        first = first_tokens.get(request_id)
        if first is None:  # ended before its first token: aborted, or it can never run here
            entry = self._prefills.pop(request_id)
            if output.finish_reason == "error":
                self._cancel_ticket(entry.ticket)
            if entry.error is not None:
                return TokenEvent(request_id, [], "error", entry.error, self.instance_id)
            return TokenEvent(request_id, [], output.finish_reason, output.error, self.instance_id)
        token_id, reason = first
        entry = self._prefills[request_id]
        if reason is not None:
            del self._prefills[request_id]  # otherwise it stays until the hand-off settles
        scheduled_at = entry.scheduled_at or entry.submitted_at
        timings = RequestTimings(
            prefill_queue_s=scheduled_at - entry.submitted_at,
            prefill_s=time.perf_counter() - scheduled_at,
            num_cached_tokens=entry.engine_request.num_cached_tokens,
        )
        return TokenEvent(request_id, [token_id], reason, None, self.instance_id, timings)

    # -------------------------------------------------------------- hand-off
    def _poll_transfers(self) -> bool:
        """Collect the ranks' ended sends and expire the overdue ones; True if any ended."""
        if not self.kv_sender.num_in_flight and not self._num_cancel_reports_due:
            return False
        tickets = {request_id: entry.ticket for request_id, entry in self._prefills.items()}
        reports: list[list[SendReport]] = self.engine.executor.collective_call("poll_sends")
        num_ended = 0
        for rank_reports in reports:
            for report in rank_reports:
                num_ended += 1
                if report.cancel:
                    self._num_cancel_reports_due -= 1
                    continue
                entry = self._prefills.get(report.request_id)
                if entry is not None and report.error is not None and entry.send_error is None:
                    entry.send_error = f"rank {report.rank}: {report.error}"
                abort = self.kv_sender.on_rank_finished(
                    report.request_id, report.rank, report.error
                )
                if abort is not None:
                    self._tell_decode(tickets[report.request_id], abort)
        for abort in self.kv_sender.expire():
            self._tell_decode(tickets[abort.request_id], abort)
        return num_ended > 0

    def _on_released(self, request_id: str, success: bool) -> None:
        """KVSender dropped the transfer's reference: the hand-off is over, either way."""
        entry = self._prefills.pop(request_id, None)
        if entry is not None and not success and not entry.quiet:
            reason = entry.send_error or "no answer from the decode side before the deadline"
            decode_id = entry.ticket.decode_instance_id
            message = f"handing the KV off to {decode_id} failed: {reason}"
            event = TokenEvent(request_id, [], "error", message, self.instance_id)
            event.failed_peer = decode_id
            self._emit([event])

    def _cancel_ticket(self, ticket: KVTicket) -> None:
        key = (ticket.request_id, ticket.transfer_id)
        if key in self._cancelled:
            return
        self._cancelled[key] = None
        if len(self._cancelled) > _MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)
        self.engine.executor.collective_call("cancel_send", ticket)
        self._num_cancel_reports_due += self.tp_size

    def _tell_decode(self, ticket: KVTicket, message: KVAbort) -> None:
        if self._send_control is not None:
            try:
                self._send_control(ticket.decode_instance_id, message)
            except Exception:  # noqa: S110 - best effort: the receive also ends at its deadline
                pass

    def check_liveness(self) -> None:
        self.engine.executor.check_ranks()  # a dead TP rank: this instance must be replaced

    def fail_all(self, message: str) -> None:
        self._emit(
            [
                TokenEvent(request_id, [], "error", message, self.instance_id)
                for request_id, entry in self._prefills.items()
                if not entry.quiet
            ]
        )
        self._prefills.clear()
