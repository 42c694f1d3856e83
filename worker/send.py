"""The sending side of the KV connector: prefill here, decode on the instance the ticket names.

    Worker.submit(request, ticket) ─▶ check the ticket, track it ─▶ the engine prefills
    Scheduler.update: first token, the stop rule lets it go on ─▶ hand_off: KVSender.start (its
        own reference on the blocks) and StartSend on every rank; the request ends here,
        handed off, and its first token goes out at once (TTFT)
    it ends here any other way (stop at its first token, abort, error) ─▶ request_finished:
        a CANCELLED header tells the decode ranks to free the reservation
    the decode side acks (KVTransferDone) or the deadline passes ─▶ the blocks are released
        (they stay in the prefix cache afterwards)

What this side reports: an error when the hand-off fails after the first token went out (unless
someone else reports the end: an abort, or the decode side). Control messages to the decode
instance (KVAbort) go through the worker's `send_control(decode_instance_id, message)`, best
effort (Worker._tell).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.executor import Executor
from engine.kv_connector import KVConnector
from engine.request import Request
from kv_transfer.messages import KVAbort, KVTicket, KVTransferDone
from kv_transfer.sender import KVSender
from prefill_worker.rank import CancelSend, PollSends, StartSend
from worker.loop import Emit
from worker.protocol import SendControl, TokenEvent, WorkerRequest

_MAX_REMEMBERED_CANCELS = 65536  # a few MB; a transfer is cancelled within seconds of its ticket


@dataclass
class _Handoff:
    ticket: KVTicket
    quiet: bool = False  # a failed send is reported by someone else (abort, decode side)
    send_error: str | None = None  # the first rank's send failure, for the error event


class SendConnector(KVConnector):
    def __init__(
        self,
        instance_id: str,
        executor: Executor,
        pool: BlockPool,
        send_control: SendControl,
        emit: Emit,
    ) -> None:
        self.instance_id = instance_id
        self.executor = executor
        self.tp_size = executor.tp_size
        self.kv_sender = KVSender(pool, self.tp_size, self._on_released)
        # What each rank pair's KV runs on ("cuda-ipc", "nccl", ...), as the ranks report it
        self.links: dict[str, str] = {}
        self._send_control = send_control
        self._emit = emit
        self._handoffs: dict[str, _Handoff] = {}
        # Transfers cancelled here (each gets one CANCELLED header, never two: a second one would
        # wait on the channel for a receive that is gone and break it), oldest first.
        self._cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._num_cancel_reports_due = 0

    # ------------------------------------------------------------- the worker's
    def check(self, request: WorkerRequest, ticket: KVTicket) -> None:
        """Raise ValueError unless `ticket` is this request's, for this instance."""
        if (ticket.request_id, ticket.transfer_id) in self._cancelled:
            raise ValueError(
                f"the decode side already aborted the transfer of {request.request_id!r}: "
                "reserve again"
            )
        kv_cache_dtype = self.executor.config.kv_cache_dtype
        if ticket.kv_cache_dtype != kv_cache_dtype:
            raise ValueError(
                f"kv_cache dtype mismatch for {request.request_id!r}: the decode instance "
                f"{ticket.decode_instance_id!r} stores KV as {ticket.kv_cache_dtype!r} and this "
                f"prefill instance as {kv_cache_dtype!r}; set the same kv_cache.dtype on both"
            )
        block_size = self.executor.block_size
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

    def track(self, ticket: KVTicket) -> None:
        """The request was queued here: its KV goes where `ticket` says."""
        self._handoffs[ticket.request_id] = _Handoff(ticket)

    def abort(self, request_id: str) -> bool:
        """Abort a hand-off in flight (the engine no longer holds the request)."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or not self.kv_sender.holds(request_id):
            return False  # its send has not started: the engine still holds the request
        handoff.quiet = True
        message = self.kv_sender.abort(request_id, "the request was aborted")
        if message is not None:
            self._send_control(handoff.ticket.decode_instance_id, message)
        return True

    def deliver(self, message: KVTransferDone | KVAbort) -> str | None:
        """A control message from a decode instance. Returns an error message when the request
        must end here before its first token (the decode side dropped the reservation)."""
        handoff = self._handoffs.get(message.request_id)
        if handoff is None and isinstance(message, KVAbort) and message.ticket is not None:
            # Never submitted here (or long gone): end the decode ranks' receives anyway, and
            # refuse the submit if it comes after all.
            self.cancel(message.ticket)
            return None
        if handoff is None or handoff.ticket.transfer_id != message.transfer_id:
            return None  # already settled: late messages are harmless
        if isinstance(message, KVTransferDone):
            handoff.quiet = handoff.quiet or not message.success  # the decode side reports it
            self.kv_sender.on_done(message)
            return None
        handoff.quiet = True
        if self.kv_sender.on_abort(message):
            return None  # every message was posted at start: the rank sends end on their own
        # Not sent yet: the decode side dropped the reservation, so the prompt is wasted work.
        return (
            f"decode instance {handoff.ticket.decode_instance_id} dropped the KV reservation: "
            f"{message.reason}"
        )

    def fail_all(self) -> list[str]:
        """The worker failed: forget every hand-off; the ids whose end is still to report."""
        ids = [i for i, h in self._handoffs.items() if self.kv_sender.holds(i) and not h.quiet]
        self._handoffs.clear()
        return ids

    # ---------------------------------------------------------------- engine hooks
    def start_step(self) -> list[Request]:
        self._poll_sends()
        return []

    def hand_off(self, request: Request) -> bool:
        handoff = self._handoffs.get(request.request_id)
        if handoff is None:
            return False
        block_ids = tuple(request.block_table[: len(handoff.ticket.block_ids)])
        self.kv_sender.start(handoff.ticket, block_ids)
        first_token_id = request.output_token_ids[0]
        self.executor.run_on_ranks(StartSend(handoff.ticket, block_ids, first_token_id))
        return True

    def request_finished(self, request: Request) -> None:
        handoff = self._handoffs.pop(request.request_id, None)
        if handoff is not None:
            self.cancel(handoff.ticket)

    def has_work(self) -> bool:
        return bool(self.kv_sender.num_in_flight or self._num_cancel_reports_due)

    # ------------------------------------------------------------------ internals
    def cancel(self, ticket: KVTicket) -> None:
        """Tell the decode ranks that this transfer will never come (once per transfer)."""
        key = (ticket.request_id, ticket.transfer_id)
        if key in self._cancelled:
            return
        self._cancelled[key] = None
        if len(self._cancelled) > _MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)
        self.executor.run_on_ranks(CancelSend(ticket))
        self._num_cancel_reports_due += self.tp_size

    def _poll_sends(self) -> None:
        """Collect the ranks' ended sends and expire the overdue ones."""
        if not self.has_work():
            return
        tickets = {request_id: handoff.ticket for request_id, handoff in self._handoffs.items()}
        for report in self.executor.run_on_ranks(PollSends()):
            self.links.update(report.links)
            if report.cancel:
                self._num_cancel_reports_due -= 1
                continue
            handoff = self._handoffs.get(report.request_id)
            if handoff is not None and report.error is not None and not handoff.send_error:
                handoff.send_error = f"rank {report.rank}: {report.error}"
            abort = self.kv_sender.on_rank_finished(report.request_id, report.rank, report.error)
            if abort is not None:
                self._send_control(tickets[report.request_id].decode_instance_id, abort)
        for abort in self.kv_sender.expire():
            self._send_control(tickets[abort.request_id].decode_instance_id, abort)

    def _on_released(self, request_id: str, success: bool) -> None:
        """KVSender dropped the transfer's reference: the hand-off is over, either way."""
        handoff = self._handoffs.pop(request_id, None)
        if handoff is not None and not success and not handoff.quiet:
            reason = handoff.send_error or "no answer from the decode side before the deadline"
            decode_id = handoff.ticket.decode_instance_id
            message = f"handing the KV off to {decode_id} failed: {reason}"
            event = TokenEvent(request_id, [], "error", message, self.instance_id)
            event.failed_peer = decode_id
            self._emit([event])
