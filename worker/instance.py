"""The one worker: an LLMEngine on a loop thread, with the KV connector sides its config names.

    Worker(WorkerConfig(engine, Role.PREFILL), "prefill-0", send_control)    prefill instance
    Worker(WorkerConfig(engine, Role.DECODE), "decode-0", send_control)      decode instance
    Worker(WorkerConfig(engine), "colocated-0")                              both phases here
    Worker(WorkerConfig(engine, Role.DECODE, sends_kv=True), ...)            decodes its own and
                                                                             prefills for others

One request, by what the router calls (worker/protocol.py):

    submit(request, None)     the engine runs both phases here; every token is an event
    submit(request, ticket)   the engine prefills; at the first token the sending connector
                              (worker/send.py) hands the KV off to the ticket's
                              decode instance: one event, the first token
    reserve(request)          the receiving connector (worker/receive.py) reserves
                              blocks; when the KV lands the request joins the engine as
                              prefilled and decodes here: an event per step

The step loop is the engine's (`LLMEngine.step`; the connector hooks sit inside it); this class
turns its outputs into TokenEvents with their timings, and answers the calls between steps on
its loop thread (worker/loop.py), so none of its state needs a lock.

Timings: each stage measured here, once (worker/timings.py, into worker/protocol.RequestTimings);
the router adds its queue time and the transfer (from the hand-off and landing stamps), and the
stages add up to the request's end-to-end time, less the router-to-worker call hops.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from dataclasses import dataclass, replace

from decode_worker.rank import DecodeRank
from engine.executor import Executor
from engine.kv_connector import KVConnectors
from engine.llm import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import StepOutput
from engine.ranks import RankCommand, RankLauncher
from kv_transfer.messages import KVAbort, KVTicket, KVTransferDone
from prefill_worker.rank import PrefillRank
from worker.config import WorkerConfig
from worker.loop import WorkerLoop, on_loop_thread
from worker.protocol import (
    ControlMessage,
    InstanceLoad,
    LoadDetails,
    Overloaded,
    PrefixReport,
    Role,
    SendControl,
    TokenEvent,
    WorkerRequest,
)
from worker.receive import ReceiveConnector
from worker.send import SendConnector
from worker.timings import TrackedRequest


class KVRankSides:
    """The rank extension: every TP rank's share of the connector sides its worker holds (the
    driver sends a side's RankCommands only to a worker that holds that side)."""

    sending: PrefillRank
    receiving: DecodeRank

    def __init__(
        self, runner: ModelRunner, sends: bool, receives: bool, host: str, transport: str = "auto"
    ) -> None:
        self._sides: list[PrefillRank | DecodeRank] = []
        if sends:
            self.sending = PrefillRank(runner, transport)
            self._sides.append(self.sending)
        if receives:
            self.receiving = DecodeRank(runner, host, transport)
            self._sides.append(self.receiving)

    def close(self) -> None:
        for side in self._sides:
            side.close()


class Worker(WorkerLoop):
    """`submit`, `reserve`, `abort`, `deliver`, `load`, `poll_events`, `shutdown`; thread-safe."""

    def __init__(
        self,
        config: WorkerConfig,
        instance_id: str,
        send_control: SendControl | None = None,
        launcher: RankLauncher | None = None,
    ) -> None:
        super().__init__(instance_id)
        self.config = config
        self.node = socket.gethostname()  # the runtime may name it better (Ray: IP and node id)
        self.role = config.role
        sends, receives = bool(config.sends_kv), bool(config.receives_kv)
        extension = functools.partial(
            KVRankSides,
            sends=sends,
            receives=receives,
            host=config.kv_transfer.host,
            transport=config.kv_transfer.transport,
        )
        executor = Executor(config.engine, rank_extension=extension, launcher=launcher)
        self._send_control = send_control
        sides = KVConnectors()
        engine_config = config.engine
        if config.role == Role.PREFILL and engine_config.speculative is not None:
            # it never decodes: no draft model beside it
            engine_config = replace(engine_config, speculative=None)
        self.engine = LLMEngine(engine_config, executor, sides)
        self.device = executor.runner.device  # the loop thread's (worker/loop.py)
        pool = self.engine.block_pool
        self.sending: SendConnector | None = None
        self.receiving: ReceiveConnector | None = None
        if sends:
            self.sending = SendConnector(instance_id, executor, pool, self._tell, self._emit)
            sides.add(self.sending)
        if receives:
            self.receiving = ReceiveConnector(
                instance_id,
                executor,
                pool,
                config.kv_transfer,
                config.watermark_blocks,
                config.engine.seed,
                self._tell,
                self._emit,
            )
            sides.add(self.receiving)
        self._tracked: dict[str, TrackedRequest] = {}  # loop thread only, like the engine
        self._not_started: dict[str, TrackedRequest] = {}  # prompts no step has computed yet
        self.start()

    # ------------------------------------------------------------------ worker API
    def submit(self, request: WorkerRequest, ticket: KVTicket | None = None) -> None:
        """Queue the prompt. With a ticket (from a decode instance's `reserve`) it decodes
        there; without one it decodes here. Raises Overloaded past the queue bounds, ValueError
        for a request that cannot run; either way the ticket's reservation is cancelled."""
        submitted_at = time.perf_counter()
        self.call(lambda: self._submit(request, ticket, submitted_at))

    @on_loop_thread
    def reserve(
        self,
        request: WorkerRequest,
        prefill_instance_id: str | None = None,
        prefill_tp_size: int = 1,
    ) -> KVTicket:
        """Reserve blocks for the prompt's KV and post the receive on every rank; the ticket
        goes to the prefill instance (`prefill_instance_id`, default `request.prefill_instance`).
        Raises Overloaded when the pool is short, ValueError for a request that cannot run."""
        request_id = request.request_id
        if self.receiving is None:
            raise ValueError(f"{self.instance_id} does not receive KV: it cannot reserve")
        prefill_id = prefill_instance_id or request.prefill_instance
        if not prefill_id:
            raise ValueError(f"request {request_id!r}: name the prefill instance that sends it")
        if (
            request_id in self._tracked
            or request_id in self.engine.scheduler.requests
            or self.receiving.holds(request_id)
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.engine.check_fits(request_id, request.prompt_token_ids, request.params)
        return self.receiving.reserve(request, prefill_id, prefill_tp_size)

    @on_loop_thread
    def abort(self, request_id: str) -> str | None:
        """Drop the request in any stage; a no-op if this instance holds nothing for it.
        Returns the stage it was in: "queued", "prefilling", "decoding", "receiving" (its KV),
        "sending" (its KV) or None."""
        request = self.engine.scheduler.requests.get(request_id)
        stage = "queued"
        if request is not None and request.num_output_tokens:
            stage = "decoding"
        elif request is not None and request.num_computed_tokens:
            stage = "prefilling"
        if self.engine.abort(request_id):  # its end comes with the next step
            return stage
        if self.receiving is not None and self.receiving.abort(request_id):
            return "receiving"
        if self.sending is not None and self.sending.abort(request_id):
            return "sending"
        return None

    @on_loop_thread
    def deliver(self, message: KVTransferDone | KVAbort) -> None:
        """A control message from the other side of a hand-off."""
        if not isinstance(message, (KVTransferDone, KVAbort)):
            raise TypeError(f"unexpected control message {type(message).__name__}")
        receiving = self.receiving
        if isinstance(message, KVAbort) and receiving and receiving.holds(message.request_id):
            receiving.deliver(message)
            return
        if self.sending is None:
            return  # a late abort of a transfer that landed: the request decodes here
        error = self.sending.deliver(message)
        if error is not None:
            tracked = self._tracked.get(message.request_id)
            if tracked is not None:
                tracked.error = error
            self.engine.abort(message.request_id)

    @on_loop_thread
    def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad:
        stats = self.engine.stats
        speculative = self.engine.config.speculative is not None
        # The decode step this engine measures at its decode batch (engine/step_costs.py),
        # which an adaptive router's latency model learns from; and its prefill gate's holds.
        decode_batch = max(1, stats.num_decoding)
        decode_step_s = self.engine.step_costs.decode_step_s(decode_batch)
        gate = self.engine.scheduler.gate
        num_receiving = self.receiving.num_receiving if self.receiving is not None else 0
        details = LoadDetails(
            chunk_size=self.config.engine.chunk_size,
            num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
            num_spec_proposed_tokens=stats.num_spec_proposed if speculative else None,
            num_spec_accepted_tokens=stats.num_spec_accepted if speculative else None,
            decode_step_s=decode_step_s,
            decode_batch=decode_batch if decode_step_s is not None else None,
            num_held_chunks=gate.num_held if gate is not None else None,
            num_transfers_in_flight=self.sending.kv_sender.num_in_flight
            if self.sending is not None
            else None,
            num_receiving=num_receiving if self.receiving is not None else None,
            node=self.node,
            kv_links=tuple(sorted(self.sending.links.items())) if self.sending is not None else (),
        )
        return InstanceLoad(
            self.instance_id,
            self.role,
            num_waiting_requests=stats.num_waiting + num_receiving,
            num_waiting_tokens=stats.num_queued_prompt_tokens,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            prefix_cache_hit_rate=stats.prefix_hit_rate,
            num_preemptions=stats.num_preemptions,
            healthy=self.healthy,
            details=details,
            prefix_cache=None
            if prefix is PrefixReport.NONE
            else self.engine.prefix_cache_changes(prefix is PrefixReport.SNAPSHOT),
        )

    def process_ids(self) -> list[int]:
        """This process and the TP ranks it spawned (tests check they are all gone at the end)."""
        return [os.getpid(), *self.engine.executor.worker_pids]

    def shutdown(self) -> None:
        self.stop()
        try:  # drop every rank's KV channels first, so that no peer waits on them
            self.engine.executor.run_on_ranks(_CloseChannels())
        except RuntimeError:
            pass  # a rank died: the executor's shutdown below still reaps the rest
        self.engine.shutdown()

    def _submit(self, request: WorkerRequest, ticket: KVTicket | None, submitted_at: float) -> None:
        request_id = request.request_id
        sending = self.sending
        if ticket is not None:
            if sending is None:
                raise ValueError(
                    f"{self.instance_id} does not prefill for other instances: submit with "
                    "ticket=None, or give it a role that sends KV"
                )
            sending.check(request, ticket)
        try:
            if request_id in self._tracked or request_id in self.engine.scheduler.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._check_queue(len(request.prompt_token_ids))
            engine_request = self.engine.add_request(
                request_id,
                request.prompt_token_ids,
                request.params,
                request.arrival_time,
                decodes_here=ticket is None,
                slo=request.slo,
            )
        except (Overloaded, ValueError):
            if sending is not None and ticket is not None:
                sending.cancel(ticket)  # the decode side frees the reservation at once
            raise
        if sending is not None and ticket is not None:
            sending.track(ticket)
        tracked = TrackedRequest(submitted_at, request=engine_request)
        self._tracked[request_id] = self._not_started[request_id] = tracked

    def _check_queue(self, num_tokens: int) -> None:
        stats = self.engine.stats
        if stats.num_waiting >= self.config.max_waiting_requests:
            raise Overloaded(
                f"{self.instance_id} has {stats.num_waiting} requests waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later"
            )
        if stats.num_queued_prompt_tokens + num_tokens > self.config.max_queued_tokens:
            raise Overloaded(
                f"{self.instance_id} has {stats.num_queued_prompt_tokens} prompt tokens queued "
                f"(max_queued_tokens={self.config.max_queued_tokens}); retry later"
            )

    # ------------------------------------------------------------------ loop thread
    def step(self) -> bool:
        engine = self.engine
        if not engine.has_unfinished():
            return False
        step_started_at = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if self._not_started:
            self._mark_started(step_started_at)
        self._emit([self._to_event(output, step_started_at, now) for output in outputs])
        # Only transfers in flight: nothing to compute, so the loop may wait (bounded) for a
        # command rather than poll the ranks in a busy loop.
        return bool(outputs) or bool(engine.scheduler.requests)

    def _mark_started(self, step_started_at: float) -> None:
        """Stop the queue clock of every request this step computed (or ended)."""
        requests = self.engine.scheduler.requests
        started = [
            request_id
            for request_id in self._not_started
            if request_id not in requests or requests[request_id].num_computed_tokens > 0
        ]
        for request_id in started:
            tracked = self._not_started.pop(request_id)
            tracked.started_at = step_started_at
            request = requests.get(request_id) or tracked.request
            tracked.num_cached_tokens = request.num_cached_tokens if request else 0

    def _to_event(self, output: StepOutput, step_started_at: float, now: float) -> TokenEvent:
        request_id = output.request_id
        landed = self.receiving.arrivals.pop(request_id, None) if self.receiving else None
        if landed is not None:  # its KV landed here: this step decoded it first (or ended it)
            self._tracked[request_id] = TrackedRequest(
                landed[0], landed_at_wall=landed[1], started_at=step_started_at
            )
        tracked = self._tracked.get(request_id)
        timings = error = None
        if tracked is not None:
            timings, error = tracked.timings_for(output, now), tracked.error
            if output.finished:
                del self._tracked[request_id]
                self._not_started.pop(request_id, None)
        if error is not None and not output.new_token_ids:
            return TokenEvent(request_id, [], "error", error, self.instance_id, timings)
        return TokenEvent(
            request_id,
            list(output.new_token_ids),
            output.finish_reason,
            output.error,
            self.instance_id,
            timings,
            logprobs=output.logprobs,
            prompt_logprobs=output.prompt_logprobs,
        )

    def _tell(self, peer_id: str, message: ControlMessage) -> None:
        """A control message to a peer, best effort: each side of a transfer has a deadline that
        ends it without the message."""
        if self._send_control is not None:
            with contextlib.suppress(Exception):
                self._send_control(peer_id, message)

    def check_liveness(self) -> None:
        self.engine.executor.check_ranks()  # a dead TP rank: this instance must be replaced

    def busy(self) -> bool:
        """Requests or KV transfers in flight (their deadlines and landings are polled)."""
        return self.engine.has_unfinished()

    def fail_all(self, message: str) -> None:
        """The loop crashed: end every request it holds with an error event. When it crashed
        because a TP rank died, the instance is lost (its process exits and is replaced): the
        events name it as the failed peer, so the router places the requests again. Any other
        crash stays a plain error, never retried: the request may be what broke the engine."""
        ids = set(self._tracked)
        for side in (self.sending, self.receiving):
            if side is not None:
                ids.update(side.fail_all())
        lost = self.instance_id if self.engine.executor.lost_ranks() else ""
        events = [TokenEvent(i, [], "error", message, self.instance_id) for i in sorted(ids)]
        for event in events:
            event.failed_peer = lost
        self._emit(events)
        self._tracked.clear()
        self._not_started.clear()


@dataclass(frozen=True)
class _CloseChannels(RankCommand[KVRankSides, None]):
    def run(self, extension: KVRankSides) -> None:
        extension.close()
