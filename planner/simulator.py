"""A discrete-event simulator of the two layouts, on a heap of events (times in ms).

Disaggregated (DistServe's model, plus transfer and memory):
  arrival -> the prefill instance with the fewest queued + running requests (FCFS queue)
  -> a prefill batch: queued prompts while their sum fits `prefill_max_tokens`; each of the pp
     stages takes (a + b*Σl + c*Σl²)/pp + pp, the first one also the step overhead;
     the first token leaves when the last stage ends (TTFT)
  -> the decode instance with the fewest requests; the KV crosses a FIFO link per pair (what
     it costs each end's core, LinkSpec.send_cpu_ms / receive_cpu_ms, lengthens the prefill
     step that sends it and the decode step after it lands)
     (with `reserve_before_prefill`, pdserve's dispatch: the decode instance is picked, and
     reserves, on arrival, between its steps, before the prompt joins the prefill queue)
  -> decode steps in groups (planner/decode_group.py) under the instance's KV memory.
Either phase may be simulated alone (no decode instances: requests end at their first token;
no prefill instances: their KV is on a decode instance when they arrive), as DistServe's
Alg. 1 sizes each phase on its own.
Colocated, two policies:
  "vllm"     DistServe's model of vLLM: a queued prompt batch runs first, whole; decode otherwise
  "chunked"  our colocated worker (engine/scheduler.py): each step runs every running decode and
             fills the rest of `max_num_batched_tokens` with prompt chunks of <= `chunk_size`.

With `decode_batch_tokens` a decode instance is DistServe's (planner/fifo_decode.py): one FIFO,
each step as many requests from its head as fit the token cap, no KV-memory limit.
With `distserve_compat` a request decodes `output_len` steps after its prefill and its TPOT is
the decode span over `output_len`, as DistServe's simulator counts; otherwise the prefill makes
the first token, decode the other `output_len - 1`, and TPOT is the span over those.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from planner.decode_group import DecodeSide, Group, RequestTable
from planner.fifo_decode import FifoBatch, FifoDecodeSide
from planner.latency import transfer_ms
from planner.sim_spec import InstanceSpec, LinkSpec, SimOptions, SimResult


@dataclass
class _Pipeline:
    """Stage free times of one instance; the first stage decides when a new step may start."""

    spec: InstanceSpec
    free: list[float] = field(default_factory=list)
    queue: deque[int] = field(default_factory=deque)  # prompts waiting (prefill / colocated)
    in_first_stage: int = 0  # requests of the batch in the first stage (DistServe's load)
    prefilling: list[list[int]] = field(default_factory=list)  # chunked: [rid, computed]
    owed_ms: float = 0.0  # core time that KV landings took, charged to the next decode step
    outstanding: int = 0  # colocated: prompt tokens placed here whose first token is not out
    busy_ms: float = 0.0  # the first stage's time in steps: the instance's own core, busy

    def __post_init__(self) -> None:
        self.free = [0.0] * self.spec.model.pp

    def run(self, now: float, first_ms: float, rest_ms: float) -> float:
        """Push a step through the stages; returns when its last stage ends."""
        t = now
        self.busy_ms += first_ms
        for k in range(len(self.free)):
            t = max(t, self.free[k]) + (first_ms if k == 0 else rest_ms)
            self.free[k] = t
        return t


# An event: what happens at its time; called with that time (ms).
_Action = Callable[[float], None]


class Simulator:
    """One run over one workload. Build, then `run()`; see the module docstring."""

    def __init__(
        self,
        prompt_lens: list[int],
        output_lens: list[int],
        arrivals_ms: list[float],
        *,
        prefill: list[InstanceSpec] | None = None,
        decode: list[InstanceSpec] | None = None,
        colocated: list[InstanceSpec] | None = None,
        link: LinkSpec | None = None,
        options: SimOptions | None = None,
    ) -> None:
        if colocated and (prefill or decode):
            raise ValueError("simulate one layout at a time: colocated, or prefill + decode")
        if not colocated and not (prefill or decode):
            raise ValueError("give colocated instances, or prefill and/or decode instances")
        self.opts = options or SimOptions()
        if colocated and self.opts.colocated_policy == "chunked":
            if any(s.model.pp != 1 for s in colocated):
                raise ValueError("the chunked colocated policy models pp = 1 only")
        compat = self.opts.distserve_compat
        steps = [o if compat else max(o - 1, 0) for o in output_lens]
        self.table = RequestTable(list(prompt_lens), steps)
        self.arrivals = arrivals_ms
        self.link = link or LinkSpec(enabled=False)
        self.colocated = [_Pipeline(s) for s in colocated or []]
        self.prefill = [_Pipeline(s) for s in prefill or []]
        self.decode = [_Pipeline(s) for s in decode or []]
        self.sides = {id(p): self._side(p.spec) for p in self.colocated + self.decode}
        self.link_free: dict[tuple[int, int], float] = {}
        self.reserved: dict[int, _Pipeline] = {}  # rid -> its decode (reserve_before_prefill)
        # (time, push order, action): the push order breaks ties, so actions are never compared.
        self.events: list[tuple[float, int, _Action]] = []
        self._seq = 0
        self.transfer_total = 0.0
        self.num_steps = 0

    def _side(self, spec: InstanceSpec) -> DecodeSide | FifoDecodeSide:
        if self.opts.decode_batch_tokens is not None:
            return FifoDecodeSide(self.table, self.opts.decode_batch_tokens)
        window = spec.model.profile.kv_window_tokens
        return DecodeSide(self.table, spec.kv_capacity, self.opts.max_num_seqs, window)

    # ------------------------------------------------------------------ loop
    def _push(self, when: float, action: _Action) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, action))

    def run(self) -> SimResult:
        arrivals, num = self.arrivals, len(self.arrivals)
        events, next_arrival = self.events, 0
        now = 0.0
        while next_arrival < num or events:
            if next_arrival < num and (not events or arrivals[next_arrival] <= events[0][0]):
                now = arrivals[next_arrival]
                self._arrive(next_arrival, now)
                next_arrival += 1
                continue
            now, _, action = heapq.heappop(events)
            action(now)
        return self._result(now)

    def _arrive(self, rid: int, now: float) -> None:
        if not (self.colocated or self.prefill):  # decode alone: the prompt's KV is there
            self.table.first_ms[rid] = now
            target = self._least_loaded_decode()
            self.sides[id(target)].waiting.append(rid)
            self._push(now, partial(self._try_start, target))
            return
        if self.decode and self.opts.reserve_before_prefill:
            target = self._least_loaded_decode()
            self.reserved[rid] = target
            if target.free[0] > now:  # its loop takes the reservation after the step under way
                self._push(target.free[0], partial(self._enqueue, rid))
                return
        self._enqueue(rid, now)

    def _least_loaded_decode(self) -> _Pipeline:
        return min(self.decode, key=lambda p: self.sides[id(p)].load())

    def _enqueue(self, rid: int, now: float) -> None:
        pool = self.colocated or self.prefill
        if self.colocated:  # pdserve's least_tokens (router/policies.py)
            pipe = min(pool, key=self._least_tokens_key)
            pipe.outstanding += self.table.prompt[rid]
        else:
            pipe = min(pool, key=lambda p: len(p.queue) + p.in_first_stage)
        pipe.queue.append(rid)
        # Start after every arrival of this instant has queued, so they share one batch.
        self._push(now, partial(self._try_start, pipe))

    def _least_tokens_key(self, pipe: _Pipeline) -> tuple[int, int]:
        """Prompt tokens placed there still to reach their first token, then its requests."""
        active = len(pipe.queue) + len(pipe.prefilling) + self.sides[id(pipe)].load()
        return (pipe.outstanding, active)

    def _try_start(self, pipe: _Pipeline, now: float) -> None:
        if pipe.free[0] > now:
            return  # the first stage is busy; its STAGE0_FREE or DONE event will call again
        pipe.in_first_stage = 0
        if self.colocated and self.opts.colocated_policy == "chunked":
            self._start_chunked(pipe, now)
        elif pipe.queue:
            self._start_prefill(pipe, now)
        elif id(pipe) in self.sides and self.sides[id(pipe)].has_work():
            self._start_decode(pipe, now)

    def _after_first_stage(self, pipe: _Pipeline, now: float) -> None:
        if len(pipe.free) > 1 and pipe.free[0] > now:
            self._push(pipe.free[0], partial(self._try_start, pipe))

    # ------------------------------------------------------------------ prefill
    def _start_prefill(self, pipe: _Pipeline, now: float) -> None:
        cap = self.opts.prefill_max_tokens or pipe.spec.kv_capacity or math.inf
        batch: list[int] = []
        sum_len, sum_sq = 0, 0
        prompt = self.table.prompt
        while pipe.queue and (not batch or sum_len + prompt[pipe.queue[0]] <= cap):
            rid = pipe.queue.popleft()
            batch.append(rid)
            sum_len += prompt[rid]
            sum_sq += prompt[rid] * prompt[rid]
        model = pipe.spec.model
        stage = model.prefill_stage_ms(sum_len, sum_sq)
        scale = self.opts.step_scale
        first = (stage + model.overhead_ms(sum_len, len(batch))) * scale
        if self.decode and self.link.enabled:  # its KV leaves this core
            first += sum(self.link.send_ms(prompt[rid]) for rid in batch) * scale
        done = pipe.run(now, first, stage * scale)
        self.num_steps += 1
        pipe.in_first_stage = len(batch)
        self._push(done, partial(self._prefill_done, pipe, batch))
        self._after_first_stage(pipe, now)

    def _prefill_done(self, pipe: _Pipeline, batch: list[int], now: float) -> None:
        table = self.table
        for rid in batch:
            table.first_ms[rid] = now
            if self.colocated:
                pipe.outstanding -= table.prompt[rid]
            if table.steps[rid] == 0 or not (self.colocated or self.decode):
                table.last_ms[rid] = now  # done, or prefill simulated alone
            elif self.colocated:
                self.sides[id(pipe)].waiting.append(rid)
            else:
                self._send_kv(pipe, rid, now)
        self._try_start(pipe, now)

    def _send_kv(self, source: _Pipeline, rid: int, now: float) -> None:
        target = self.reserved.pop(rid, None) or self._least_loaded_decode()
        if not self.link.enabled:
            self.sides[id(target)].waiting.append(rid)
            # After the rest of this batch has landed, so it joins the same decode step.
            self._push(now, partial(self._try_start, target))
            return
        link = self.link
        same_node = source.spec.node == target.spec.node
        bandwidth = link.intra_node_GBps if same_node else link.cross_node_GBps
        cost = transfer_ms(
            self.table.prompt[rid], link.bytes_per_token, bandwidth, link.per_message_ms
        )
        key = (id(source), id(target))
        start = max(now, self.link_free.get(key, 0.0))
        self.link_free[key] = start + cost
        self.transfer_total += cost
        self._push(start + cost + link.handoff_ms, partial(self._kv_arrived, rid, target))

    def _kv_arrived(self, rid: int, target: _Pipeline, now: float) -> None:
        target.owed_ms += self.link.receive_ms(self.table.prompt[rid])
        self.sides[id(target)].waiting.append(rid)
        self._push(now, partial(self._try_start, target))  # after every KV landing this instant

    # ------------------------------------------------------------------ decode
    def _start_decode(self, pipe: _Pipeline, now: float) -> None:
        side = self.sides[id(pipe)]
        group, recomputed, recomputed_sq = side.form()
        if group.n == 0:
            return  # waiting requests do not fit until a group in flight frees memory
        model = pipe.spec.model
        sum_ctx = group.sum_ctx
        stage = model.decode_stage_ms(group.n, sum_ctx)
        if recomputed:
            stage += model.prefill_stage_ms(recomputed, recomputed_sq) - model.pp
        scale = self.opts.step_scale
        first = (stage + model.overhead_ms(sum_ctx, group.n) + pipe.owed_ms) * scale
        pipe.owed_ms = 0.0
        done = pipe.run(now, first, stage * scale)
        self.num_steps += 1
        self._push(done, partial(self._decode_done, pipe, group))
        self._after_first_stage(pipe, now)

    def _decode_done(self, pipe: _Pipeline, batch: Group | FifoBatch, now: float) -> None:
        side = self.sides[id(pipe)]
        # `batch` came from this side's `form`, so the two types pair up.
        if isinstance(side, FifoDecodeSide):
            assert isinstance(batch, FifoBatch), "a FifoDecodeSide forms FifoBatches"
            side.advance(batch, now)
        else:
            assert isinstance(batch, Group), "a DecodeSide forms Groups"
            side.advance(batch, now)
        self._try_start(pipe, now)

    # ------------------------------------------------------------------ chunked colocated
    def _chunked_side(self, pipe: _Pipeline) -> DecodeSide:
        side = self.sides[id(pipe)]
        # SimOptions refuses decode_batch_tokens (the FIFO model) with the chunked policy.
        assert isinstance(side, DecodeSide), "the chunked policy runs on DecodeSide"
        return side

    def _start_chunked(self, pipe: _Pipeline, now: float) -> None:
        side = self._chunked_side(pipe)
        group, recomputed, recomputed_sq = side.form()
        budget = self.opts.max_num_batched_tokens - group.n
        chunks = self._pick_chunks(pipe, side, budget)
        if group.n == 0 and not chunks:
            return
        sum_chunk = recomputed + sum(m for _, _, m in chunks)
        sum_attn = recomputed_sq + sum(m * m + 2 * m * p for _, p, m in chunks)
        model = pipe.spec.model
        sum_ctx = group.sum_ctx
        step = model.mixed_ms(group.n, sum_ctx, sum_chunk, sum_attn)
        seqs = group.n + len(chunks)
        first = (step + model.overhead_ms(sum_ctx + sum_chunk, seqs)) * self.opts.step_scale
        done = pipe.run(now, first, step * self.opts.step_scale)
        self.num_steps += 1
        self._push(done, partial(self._chunk_done, pipe, group, chunks))

    def _pick_chunks(
        self, pipe: _Pipeline, side: DecodeSide, budget: int
    ) -> list[tuple[int, int, int]]:
        """(rid, computed before, chunk) for the partial prompts, then new ones FCFS."""
        table, chunk_size = self.table, self.opts.chunk_size
        chunks: list[tuple[int, int, int]] = []
        for entry in pipe.prefilling:
            if budget <= 0:
                break
            rid, computed = entry
            size = min(table.prompt[rid] - computed, chunk_size, budget)
            chunks.append((rid, computed, size))
            budget -= size
        while budget > 0 and pipe.queue:
            rid = pipe.queue[0]
            need = table.prompt[rid]
            busy = side.num_stepping + len(side.waiting) + len(pipe.prefilling)
            if busy >= side.max_seqs or (side.used + need > side.capacity and busy > 0):
                break  # the engine admits a prompt only when its blocks fit
            pipe.queue.popleft()
            side.used += need
            table.held[rid] = need
            pipe.prefilling.append([rid, 0])
            size = min(need, chunk_size, budget)
            chunks.append((rid, 0, size))
            budget -= size
        return chunks

    def _chunk_done(
        self, pipe: _Pipeline, group: Group, chunks: list[tuple[int, int, int]], now: float
    ) -> None:
        side = self._chunked_side(pipe)
        if group.n:
            side.advance(group, now)
        table = self.table
        for rid, computed, size in chunks:
            entry = next(e for e in pipe.prefilling if e[0] == rid)
            entry[1] = computed + size
            if entry[1] < table.prompt[rid]:
                continue
            pipe.prefilling.remove(entry)
            pipe.outstanding -= table.prompt[rid]
            table.first_ms[rid] = now
            if table.steps[rid] == 0:
                table.last_ms[rid] = now
                side.used -= table.held[rid]
                table.held[rid] = 0
            else:
                side.waiting.append(rid)
        self._try_start(pipe, now)

    # ------------------------------------------------------------------ results
    def _result(self, end: float) -> SimResult:
        table = self.table
        arrivals = np.asarray(self.arrivals, dtype=float)
        first = np.asarray(table.first_ms)
        last = np.asarray(table.last_ms)
        steps = np.asarray(table.steps, dtype=float)
        span = last - first
        tpot = np.divide(span, steps, out=np.zeros_like(span), where=steps > 0)
        preemptions = sum(side.num_preemptions for side in self.sides.values())
        ttft = first - arrivals + self.opts.ttft_path_ms
        pipes = self.colocated + self.prefill + self.decode
        busy = tuple(p.busy_ms for p in pipes)
        devices = tuple(p.spec.tp * p.spec.model.pp for p in pipes)
        return SimResult(
            ttft, tpot, preemptions, end, self.transfer_total, self.num_steps, busy, devices
        )
