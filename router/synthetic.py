"""Workers without a model, for router tests and the router benchmark.

They implement the handle interfaces of router/worker_api.py with the real KV bookkeeping
(`engine.block_pool.BlockPool`) and emit made-up tokens on a fixed clock, so what they measure
or check is the router: its dispatch, streaming, cancellation and overhead.

    SyntheticDecode   reserve() allocates blocks for prompt + max_tokens (Overloaded if it
                      cannot); one event per running request per step of `step_interval_s`.
    SyntheticPrefill  submit() (answered after `submit_delay_s`) holds blocks for the prompt
                      for `prefill_delay_s`, emits the first token, hands the request to the
                      decode instance named in the ticket, frees.
    SyntheticColocated both in one instance (ticket=None).

Tokens cycle through ids [3, vocab_size) from a per-request offset; `emit_times[request_id]`
records when each token was produced (time.perf_counter), for the benchmark, by the client's
request_id. A request finishes
with "length" after max_tokens tokens.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import BlockPool
from router.worker_api import (
    InstanceLoad,
    KVTicket,
    Overloaded,
    PrefixReport,
    Role,
    TokenEvent,
    WorkerRequest,
)
from router.worker_pool import client_request_id

_FIRST_ORDINARY_ID = 3  # ids 0-2 are <unk>, <s>, </s> in the tiny tokenizer


@dataclass
class _Sequence:
    request: WorkerRequest
    block_ids: list[int]
    num_emitted: int = 0
    running: bool = False  # decode: KV has arrived


@dataclass
class SyntheticWorker:
    instance_id: str
    role: Role
    num_blocks: int = 256
    block_size: int = 16
    vocab_size: int = 512
    step_interval_s: float = 0.01
    prefill_delay_s: float = 0.005
    submit_delay_s: float = 0.0  # submit()'s answer time (an engine answers between steps)
    record_emit_times: bool = False
    peers: dict[str, SyntheticWorker] = field(default_factory=dict)  # decode instances by id

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, enable_caching=False)
        self.emit_times: dict[str, list[float]] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._events: list[TokenEvent] = []
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._step_task: asyncio.Task[None] | None = None

    # -- the handle interface -----------------------------------------------------------------

    async def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad:
        num_waiting = sum(1 for s in self._sequences.values() if not s.running)
        return InstanceLoad(
            self.instance_id,
            self.role,
            num_waiting_requests=num_waiting,
            num_running=len(self._sequences) - num_waiting,
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.num_blocks,
            prefix_cache=None
            if prefix is PrefixReport.NONE
            else self.pool.take_cache_changes(prefix is PrefixReport.SNAPSHOT),
        )

    async def abort(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.pool.free(sequence.block_ids)

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        if not self._events:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        events, self._events = self._events, []
        return events

    async def reserve(self, request: WorkerRequest) -> KVTicket:
        num_tokens = len(request.prompt_token_ids) + request.params.max_tokens
        blocks = self._allocate(request, num_tokens)
        return KVTicket(
            request.request_id,
            0,
            tuple(blocks),
            len(request.prompt_token_ids),
            request.prefill_instance,
            1,
            self.instance_id,
            1,
            (),
            False,
            0.0,
        )

    async def submit(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        if self.submit_delay_s:
            await asyncio.sleep(self.submit_delay_s)
        self._allocate(request, len(request.prompt_token_ids))
        task = asyncio.create_task(self._prefill(request, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the made-up work -----------------------------------------------------------------------

    def _allocate(self, request: WorkerRequest, num_tokens: int) -> list[int]:
        num_blocks = math.ceil(num_tokens / self.block_size)
        if not self.pool.can_allocate(num_blocks):
            raise Overloaded(f"{self.instance_id} has {self.pool.num_free_blocks} free blocks")
        blocks = self.pool.allocate(num_blocks)
        self._sequences[request.request_id] = _Sequence(request, blocks)
        return blocks

    async def _prefill(self, request: WorkerRequest, ticket: KVTicket | None) -> None:
        await asyncio.sleep(self.prefill_delay_s)
        sequence = self._sequences.get(request.request_id)
        if sequence is None:  # aborted while "prefilling"
            return
        if self.role == Role.COLOCATED:
            self._emit(sequence)
            sequence.running = True
            self._ensure_stepping()
            return
        self._emit(sequence)
        await self.abort(request.request_id)  # the KV "moved": free the prefill side
        decode = None if ticket is None else self.peers.get(ticket.decode_instance_id)
        if decode is not None and sequence.num_emitted < request.params.max_tokens:
            decode.kv_arrived(request.request_id, sequence.num_emitted)

    def kv_arrived(self, request_id: str, num_emitted: int) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is not None:  # else aborted before the KV landed
            sequence.num_emitted = num_emitted
            sequence.running = True
            self._ensure_stepping()

    def _ensure_stepping(self) -> None:
        if self._step_task is None or self._step_task.done():
            self._step_task = asyncio.create_task(self._step_loop())

    async def _step_loop(self) -> None:
        while any(s.running for s in self._sequences.values()):
            await asyncio.sleep(self.step_interval_s)
            for sequence in [s for s in self._sequences.values() if s.running]:
                self._emit(sequence)

    def _emit(self, sequence: _Sequence) -> None:
        request = sequence.request
        offset = sum(request.prompt_token_ids) + sequence.num_emitted
        token_id = _FIRST_ORDINARY_ID + offset % (self.vocab_size - _FIRST_ORDINARY_ID)
        sequence.num_emitted += 1
        finished = sequence.num_emitted >= request.params.max_tokens
        event = TokenEvent(
            request.request_id,
            [token_id],
            finish_reason="length" if finished else None,
            source=self.instance_id,
        )
        if self.record_emit_times:
            client_id = client_request_id(request.request_id)
            self.emit_times.setdefault(client_id, []).append(time.time())
        if finished:
            self._sequences.pop(request.request_id, None)
            self.pool.free(sequence.block_ids)
        self._events.append(event)
        self._wakeup.set()

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._step_task] if self._step_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def synthetic_cluster(
    num_prefill: int, num_decode: int, **options: Any
) -> tuple[list[SyntheticWorker], list[SyntheticWorker]]:
    """Prefill and decode instances wired to each other (colocated ones if num_decode == 0).
    `options` are SyntheticWorker fields shared by all instances."""
    if num_decode == 0:
        colocated = [
            SyntheticWorker(f"colocated-{i}", Role.COLOCATED, **options) for i in range(num_prefill)
        ]
        return colocated, []
    decodes = [SyntheticWorker(f"decode-{i}", Role.DECODE, **options) for i in range(num_decode)]
    peers = {d.instance_id: d for d in decodes}
    prefills = [
        SyntheticWorker(f"prefill-{i}", Role.PREFILL, peers=peers, **options)
        for i in range(num_prefill)
    ]
    return prefills, decodes
