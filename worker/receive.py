"""The receiving side of the KV connector: a prefill instance sends the prompt's KV here.

    Worker.reserve(request) ─▶ blocks reserved (KVReceiver), StartReceive on every rank ─▶ ticket
    ... the prefill instance sends the prompt's KV and, in the trailer, the first token ...
    every rank's receive ended ─▶ KVTransferDone to the prefill instance (send_control)
        └─ landed: start_step returns Request(prompt, [first token], the ticket's blocks,
           num_computed = prompt), which joins the scheduler as prefilled and decodes with
           continuous batching like any other request

When the prefill side cancels a transfer on purpose (the request ended at its first token, or
was aborted there) this side frees the reservation silently: the prefill side reports those
ends. Any other failed hand-off ends the request with an error event.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from decode_worker.rank import Endpoints, PollReceives, StartReceive
from engine.block_pool import BlockPool
from engine.executor import Executor
from engine.kv_connector import KVConnector
from engine.request import Request
from kv_transfer.channel import ChannelEndpoint
from kv_transfer.config import KVTransferConfig
from kv_transfer.messages import KVAbort, KVRefusal, KVReserveRequest, KVTicket, KVTransferDone
from kv_transfer.receiver import KVReceiver
from worker.loop import Emit
from worker.protocol import Overloaded, SendControl, TokenEvent, WorkerRequest

_MAX_REMEMBERED_ABORTS = 65536  # a few MB; a late reserve trails its abort by milliseconds


@dataclass
class _Incoming:
    request: WorkerRequest
    ticket: KVTicket
    first_token_id: int | None = None
    first_token_at: float | None = None  # the prefill side's time.time() at the first token
    cancelled: bool = False  # the prefill side cancelled the transfer on purpose


class ReceiveConnector(KVConnector):
    def __init__(
        self,
        instance_id: str,
        executor: Executor,
        pool: BlockPool,
        config: KVTransferConfig,
        watermark_blocks: int,
        seed: int,
        send_control: SendControl,
        emit: Emit,
    ) -> None:
        self.instance_id = instance_id
        self.executor = executor
        self.pool = pool
        self.watermark_blocks = watermark_blocks
        endpoints: list[ChannelEndpoint] = executor.run_on_ranks(Endpoints())
        self.kv_receiver = KVReceiver(
            pool,
            executor.block_size,
            instance_id,
            endpoints,
            config,
            kv_cache_dtype=executor.config.kv_cache_dtype,
        )
        self._send_control = send_control
        self._emit = emit
        self._incoming: dict[str, _Incoming] = {}
        self._num_reports_due = 0  # rank receives posted and not reported yet
        self._seeds = random.Random(seed)
        # Ids aborted before their reservation arrived, oldest first. Ray delivers a worker's
        # calls on several threads, so a client's cancel can overtake the reserve it follows;
        # a reservation made after its abort would sit until the start deadline (60 s+).
        self._aborted_early: OrderedDict[str, None] = OrderedDict()
        # request_id -> when its KV landed (time.perf_counter, time.time), until its first event
        self.arrivals: dict[str, tuple[float, float]] = {}

    @property
    def num_receiving(self) -> int:
        return len(self._incoming)

    # ------------------------------------------------------------- the worker's
    def reserve(self, request: WorkerRequest, prefill_id: str, prefill_tp_size: int) -> KVTicket:
        request_id = request.request_id
        if request_id in self._aborted_early:
            raise ValueError(f"request {request_id!r} was aborted before its reservation arrived")
        num_blocks = -(-len(request.prompt_token_ids) // self.executor.block_size)
        num_free = self.pool.num_free_blocks
        if num_free - num_blocks < self.watermark_blocks:
            raise Overloaded(
                f"{self.instance_id} has {num_free} free KV blocks; the prompt needs {num_blocks} "
                f"and {self.watermark_blocks} stay free for running sequences"
            )
        answer = self.kv_receiver.reserve(
            KVReserveRequest(request_id, len(request.prompt_token_ids), prefill_id, prefill_tp_size)
        )
        if isinstance(answer, KVRefusal):
            raise Overloaded(
                f"{self.instance_id}: {answer.reason} ({answer.num_blocks_needed} needed, "
                f"{answer.num_free_blocks} free)"
            )
        self.executor.run_on_ranks(StartReceive(answer))
        self._num_reports_due += self.executor.tp_size
        params = request.params
        if not params.greedy and params.seed is None:
            # Drawn once, so a preempted request replays the same draws when recomputed.
            request = replace(request, params=replace(params, seed=self._seeds.getrandbits(63)))
        self._incoming[request_id] = _Incoming(request, answer)
        return answer

    def holds(self, request_id: str) -> bool:
        return request_id in self._incoming

    def abort(self, request_id: str) -> bool:
        """Drop a reservation whose KV has not landed; False if there is none (then a reserve
        that arrives later is refused)."""
        incoming = self._incoming.pop(request_id, None)
        if incoming is None:
            self._aborted_early[request_id] = None
            if len(self._aborted_early) > _MAX_REMEMBERED_ABORTS:
                self._aborted_early.popitem(last=False)
            return False
        message = self.kv_receiver.abort(request_id, "the request was aborted")
        if message is not None:  # the prefill side finishes the wire protocol at once
            self._send_control(incoming.ticket.prefill_instance_id, message)
        self._emit([TokenEvent(request_id, [], "abort", None, self.instance_id)])
        return True

    def deliver(self, message: KVAbort) -> None:
        incoming = self._incoming.get(message.request_id)
        if incoming is not None and incoming.ticket.transfer_id == message.transfer_id:
            del self._incoming[message.request_id]  # the prefill side reports the end
            self.kv_receiver.on_abort(message)  # blocks freed once every rank has ended

    def fail_all(self) -> list[str]:
        ids = list(self._incoming)
        self._incoming.clear()
        return ids

    # ---------------------------------------------------------------- engine hooks
    def start_step(self) -> list[Request]:
        """Take the ranks' ended receives: ack them; the landed requests join the engine."""
        landed: list[Request] = []
        reports = self.executor.run_on_ranks(PollReceives()) if self._num_reports_due else []
        for report in reports:
            self._num_reports_due -= 1
            incoming = self._incoming.get(report.request_id)
            if incoming is not None and incoming.ticket.transfer_id == report.transfer_id:
                incoming.cancelled = incoming.cancelled or report.cancelled
                if report.first_token_id is not None:
                    incoming.first_token_id = report.first_token_id
                    incoming.first_token_at = report.first_token_at
            ack = self.kv_receiver.on_rank_finished(report.request_id, report.rank, report.error)
            landed.extend(self._settled(report.request_id, ack))
        for ack in self.kv_receiver.expire():
            landed.extend(self._settled(ack.request_id, ack))
        return landed

    def has_work(self) -> bool:
        return self._num_reports_due > 0

    # ------------------------------------------------------------------ internals
    def _settled(self, request_id: str, ack: KVTransferDone | None) -> list[Request]:
        incoming = self._incoming.get(request_id)
        if ack is not None and incoming is not None:
            self._send_control(incoming.ticket.prefill_instance_id, ack)
        if self.kv_receiver.is_landed(request_id):
            return self._join(request_id)
        if ack is not None and not ack.success and incoming is not None:
            del self._incoming[request_id]
            if not incoming.cancelled:
                prefill_id = incoming.ticket.prefill_instance_id
                message = f"receiving the KV from {prefill_id} failed: {ack.error}"
                # The hand-off broke (a dead, stalled or cut-off sender): the router may place
                # the request again, as when the sending side reports its decode peer gone.
                event = TokenEvent(request_id, [], "error", message, self.instance_id)
                event.failed_peer = prefill_id
                self._emit([event])
        return []

    def _join(self, request_id: str) -> list[Request]:
        """The KV landed: the request joins the running batch at the next step with room."""
        ticket = self.kv_receiver.claim(request_id)
        incoming = self._incoming.pop(request_id)
        if incoming.first_token_id is None:  # a sender that skipped the trailer's token: a bug
            self.pool.free_sequence_blocks(ticket.block_ids)
            error = "the KV landed without the first token"
            self._emit([TokenEvent(request_id, [], "error", error, self.instance_id)])
            return []
        request = incoming.request
        landed_at = time.time()
        self.arrivals[request_id] = (time.perf_counter(), landed_at)
        return [
            Request(
                request_id,
                list(request.prompt_token_ids),
                request.params,
                request.arrival_time,
                output_token_ids=[incoming.first_token_id],
                block_table=list(ticket.block_ids),
                num_computed_tokens=len(request.prompt_token_ids),
                slo=request.slo,
                first_token_at=incoming.first_token_at or landed_at,
            )
        ]
