"""The decode instance: KV lands in its paged pool, sequences join the running batch, tokens flow.

One instance (TP optional, default 1) in a data-parallel set of replicas; this object lives in
the driver process (rank 0). One request:

    reserve(request) ─▶ blocks reserved (KVReceiver), a receive posted on every rank ─▶ ticket
    ... the prefill instance sends the prompt's KV and, in the trailer, the first token ...
    every rank's receive ended ─▶ KVTransferDone to the prefill instance (send_control)
        └─ landed: Request(prompt, [first token], the ticket's blocks, num_computed = prompt)
           joins the scheduler (`add_prefilled`) and decodes with continuous batching;
           each step emits one TokenEvent per request that advanced.

Stops (EOS, stop ids, max_tokens counting the first token, model length) and preemption under
block pressure (recompute from prompt + generated tokens, so outputs stay identical) come from
the engine's Scheduler. When the prefill side cancels a transfer (the request ended at its first
token, or was aborted there) this side frees the reservation silently: the prefill side reports
those ends. Any other failed hand-off ends the request with an error event.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from decode_worker.config import DecodeConfig
from decode_worker.rank import DecodeRank, RecvReport
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
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone
from kv_transfer.receiver import KVReceiver

SendControl = Callable[[str, Any], None]
_MAX_REMEMBERED_ABORTS = 65536  # a few MB; a late reserve trails its abort by milliseconds


@dataclass
class _Tracked:
    """A request this instance holds: receiving its KV, then decoding."""

    request: WorkerRequest
    ticket: KVTicket
    reserved_at: float  # time.perf_counter()
    first_token_id: int | None = None
    cancelled: bool = False  # the prefill side cancelled the transfer on purpose
    landed_at: float | None = None  # set when it joined the scheduler
    timings: RequestTimings | None = None  # set with its first decode event


class DecodeWorker(WorkerLoop):
    """`reserve`, `abort`, `deliver`, `load`, `poll_events`, `shutdown`; thread-safe."""

    role = Role.DECODE

    def __init__(
        self,
        config: DecodeConfig,
        instance_id: str,
        send_control: SendControl | None = None,
        start: bool = True,
        launcher: RankLauncher | None = None,
    ) -> None:
        super().__init__(instance_id)
        self.config = config
        self.tp_size = config.engine.tensor_parallel_size
        extension = functools.partial(DecodeRank, host=config.kv_transfer.host)
        executor = Executor(config.engine, rank_extension=extension, launcher=launcher)
        self.engine = LLMEngine(config.engine, executor)
        self.block_size = self.engine.executor.block_size
        self.kv_receiver = KVReceiver(
            self.engine.block_pool,
            self.block_size,
            instance_id,
            self.engine.executor.collective_call("endpoints"),
            config.kv_transfer,
        )
        self._send_control = send_control
        self._tracked: dict[str, _Tracked] = {}
        self._num_reports_due = 0  # rank receives posted and not reported yet
        # Ids aborted before their reservation arrived, oldest first. Ray delivers a worker's
        # calls on several threads, so a client's cancel can overtake the reserve it follows;
        # a reservation made after its abort would sit until the start deadline (60 s+).
        self._aborted_early: OrderedDict[str, None] = OrderedDict()
        self._seeds = random.Random(config.engine.seed)
        if start:
            self.start()

    # ----------------------------------------------------------- public API
    def reserve(
        self,
        request: WorkerRequest,
        prefill_instance_id: str | None = None,
        prefill_tp_size: int = 1,
    ) -> KVTicket:
        """Reserve blocks for the prompt's KV and post the receive on every rank; the ticket
        goes to the prefill instance (`prefill_instance_id`, default `request.prefill_instance`).
        Raises Overloaded when the pool is short, ValueError for a request that cannot run."""
        return self.call(lambda: self._reserve(request, prefill_instance_id, prefill_tp_size))

    def abort(self, request_id: str) -> str | None:
        """Drop the request in any stage; a no-op if this instance holds nothing for it.
        Returns the stage it was in: "receiving", "decoding" (or None)."""
        return self.call(lambda: self._abort(request_id))

    def deliver(self, message: KVAbort) -> None:
        """A control message from a prefill instance."""
        self.call(lambda: self._deliver(message))

    def load(self) -> InstanceLoad:
        return self.call(self._load)

    def process_ids(self) -> list[int]:
        """This process and the TP ranks it spawned."""
        return [os.getpid(), *self.engine.executor.worker_pids]

    def shutdown(self) -> None:
        self.stop()
        try:  # drop every rank's KV channels first, so that no peer waits on them
            self.engine.executor.collective_call("close")
        except RuntimeError:
            pass  # a rank died: the executor's shutdown below still reaps the rest
        self.engine.shutdown()

    # ----------------------------------------------------------- commands
    def _reserve(
        self, request: WorkerRequest, prefill_instance_id: str | None, prefill_tp_size: int
    ) -> KVTicket:
        request_id = request.request_id
        prefill_id = prefill_instance_id or request.prefill_instance
        if not prefill_id:
            raise ValueError(f"request {request_id!r}: name the prefill instance that sends it")
        if request_id in self._tracked or request_id in self.engine.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if request_id in self._aborted_early:
            raise ValueError(f"request {request_id!r} was aborted before its reservation arrived")
        self._check_fits(request)
        num_blocks = -(-len(request.prompt_token_ids) // self.block_size)
        num_free = self.engine.block_pool.num_free_blocks
        if num_free - num_blocks < self.config.watermark_blocks:
            raise Overloaded(
                f"{self.instance_id} has {num_free} free KV blocks; the prompt needs {num_blocks} "
                f"and {self.config.watermark_blocks} stay free for running sequences"
            )
        answer = self.kv_receiver.reserve(
            KVReserveRequest(request_id, len(request.prompt_token_ids), prefill_id, prefill_tp_size)
        )
        if isinstance(answer, KVRefusal):
            raise Overloaded(
                f"{self.instance_id}: {answer.reason} ({answer.num_blocks_needed} needed, "
                f"{answer.num_free_blocks} free)"
            )
        self.engine.executor.collective_call("start_receive", answer)
        self._num_reports_due += self.tp_size
        params = request.params
        if not params.greedy and params.seed is None:
            # Drawn once, so a preempted request replays the same draws when recomputed.
            request = replace(request, params=replace(params, seed=self._seeds.getrandbits(63)))
        self._tracked[request_id] = _Tracked(request, answer, time.perf_counter())
        return answer

    def _check_fits(self, request: WorkerRequest) -> None:
        num_prompt = len(request.prompt_token_ids)
        max_model_len = self.engine.max_model_len
        vocab_size = self.engine.executor.model_config.vocab_size
        if num_prompt == 0 or num_prompt >= max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {num_prompt} tokens; it needs "
                f"1 to {max_model_len - 1} (max_model_len {max_model_len})"
            )
        if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) for this model")
        max_len = min(num_prompt + request.params.max_tokens, max_model_len)
        num_blocks = -(-max_len // self.block_size)
        if num_blocks > self.engine.block_pool.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may grow to {max_len} tokens ({num_blocks} KV "
                f"blocks), but the pool has {self.engine.block_pool.num_blocks}: lower max_tokens"
            )

    def _abort(self, request_id: str) -> str | None:
        if self.engine.abort(request_id):
            return "decoding"  # the scheduler reports its end with the next step
        entry = self._tracked.pop(request_id, None)
        if entry is None:
            self._aborted_early[request_id] = None
            if len(self._aborted_early) > _MAX_REMEMBERED_ABORTS:
                self._aborted_early.popitem(last=False)
            return None
        message = self.kv_receiver.abort(request_id, "the request was aborted")
        if message is not None:  # the prefill side finishes the wire protocol at once
            self._tell_prefill(entry.ticket, message)
        self._emit([TokenEvent(request_id, [], "abort", None, self.instance_id)])
        return "receiving"

    def _deliver(self, message: KVAbort) -> None:
        if not isinstance(message, KVAbort):
            raise TypeError(f"unexpected control message {type(message).__name__}")
        entry = self._tracked.get(message.request_id)
        if entry is None or entry.landed_at is not None:
            return  # not here, or its KV already landed: the abort is stale
        if entry.ticket.transfer_id == message.transfer_id:
            del self._tracked[message.request_id]  # the prefill side reports the end
            self.kv_receiver.on_abort(message)  # blocks freed once every rank has ended

    def _load(self) -> InstanceLoad:
        num_receiving = sum(1 for entry in self._tracked.values() if entry.landed_at is None)
        return InstanceLoad.from_stats(
            self.instance_id,
            Role.DECODE,
            self.engine.stats,
            self.healthy,
            num_other_waiting=num_receiving,
            num_receiving=num_receiving,
        )

    # --------------------------------------------------------------- the step
    def step(self) -> bool:
        progressed = self._poll_transfers()
        if not self.engine.has_unfinished():
            return progressed
        outputs = self.engine.step()
        self._emit([self._to_event(output) for output in outputs])
        return progressed or bool(outputs) or bool(self.engine.scheduler.running)

    def _to_event(self, output: StepOutput) -> TokenEvent:
        entry = self._tracked.get(output.request_id)
        timings = None
        if entry is not None:
            now = time.perf_counter()
            landed_at = entry.landed_at or now
            if entry.timings is None:
                timings = entry.timings = RequestTimings(
                    kv_transfer_s=landed_at - entry.reserved_at, decode_queue_s=now - landed_at
                )
            if output.finished:
                del self._tracked[output.request_id]
                timings = entry.timings
                timings.decode_s = now - landed_at
        return TokenEvent(
            output.request_id,
            list(output.new_token_ids),
            output.finish_reason,
            output.error,
            self.instance_id,
            timings,
        )

    # -------------------------------------------------------------- hand-off
    def _poll_transfers(self) -> bool:
        """Take the ranks' ended receives: ack them, and start the landed requests."""
        if self._num_reports_due:
            reports: list[list[RecvReport]] = self.engine.executor.collective_call("poll_receives")
        else:
            reports = []
        num_ended = 0
        for rank_reports in reports:
            for report in rank_reports:
                num_ended += 1
                self._num_reports_due -= 1
                entry = self._tracked.get(report.request_id)
                if entry is not None and entry.ticket.transfer_id == report.transfer_id:
                    entry.cancelled = entry.cancelled or report.cancelled
                    if report.first_token_id is not None:
                        entry.first_token_id = report.first_token_id
                ack = self.kv_receiver.on_rank_finished(
                    report.request_id, report.rank, report.error
                )
                self._settled(report.request_id, ack)
        for ack in self.kv_receiver.expire():
            self._settled(ack.request_id, ack)
        return num_ended > 0

    def _settled(self, request_id: str, ack: KVTransferDone | None) -> None:
        entry = self._tracked.get(request_id)
        if ack is not None and entry is not None:
            self._tell_prefill(entry.ticket, ack)
        if self.kv_receiver.is_landed(request_id):
            self._join(request_id)
        elif ack is not None and not ack.success and entry is not None:
            del self._tracked[request_id]
            if not entry.cancelled:
                message = f"receiving the KV from {entry.ticket.prefill_instance_id} failed: "
                self._emit(
                    [
                        TokenEvent(
                            request_id, [], "error", message + str(ack.error), self.instance_id
                        )
                    ]
                )

    def _join(self, request_id: str) -> None:
        """The KV landed: the request joins the running batch at the next step with room."""
        ticket = self.kv_receiver.claim(request_id)
        entry = self._tracked[request_id]
        if entry.first_token_id is None:  # a sender that skipped the trailer's token: a bug
            self.engine.block_pool.free_sequence_blocks(ticket.block_ids)
            del self._tracked[request_id]
            error = "the KV landed without the first token"
            self._emit([TokenEvent(request_id, [], "error", error, self.instance_id)])
            return
        request = entry.request
        self.engine.scheduler.add_prefilled(
            Request(
                request_id,
                list(request.prompt_token_ids),
                request.params,
                request.arrival_time,
                output_token_ids=[entry.first_token_id],
                block_table=list(ticket.block_ids),
                num_computed_tokens=len(request.prompt_token_ids),
            )
        )
        entry.landed_at = time.perf_counter()

    def _tell_prefill(self, ticket: KVTicket, message: KVTransferDone | KVAbort) -> None:
        if self._send_control is not None:
            try:
                self._send_control(ticket.prefill_instance_id, message)
            except Exception:  # noqa: S110 - best effort: the prefill side has its deadline
                pass

    def check_liveness(self) -> None:
        self.engine.executor.check_ranks()  # a dead TP rank: this instance must be replaced

    def fail_all(self, message: str) -> None:
        self._emit(
            [
                TokenEvent(request_id, [], "error", message, self.instance_id)
                for request_id in self._tracked
            ]
        )
        self._tracked.clear()
