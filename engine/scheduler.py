"""Continuous batching with chunked prefill, a prefix cache and preemption. Pure Python.

One engine step reads:

    batch = scheduler.schedule()                  # which tokens of which requests to compute
    logits = executor.execute(batch)               # [batch.num_sampled, vocab]
    sampled = sampler(logits, scheduler.sampling_rows(batch))
    outputs = scheduler.update(batch, sampled)     # append tokens, stop, free, cache blocks

The stop rule lives here, once. A KV connector (engine/kv_connector.py) hooks into `update` and
`_finish`: a request whose decode runs elsewhere ends here, handed off, with its first token.

`schedule()` fills one step under `max_num_seqs` and `max_num_batched_tokens`, in this order:
  1. running requests that decode (one token each; a new block when one fills up),
  2. running requests whose prefill is partial (the next chunk of at most `chunk_size` tokens),
  3. requests whose prompt KV arrived from elsewhere (a prefill instance), in arrival order,
  4. waiting requests, first come first served, each starting after its cached prefix.
Decodes go first so that a long prompt never stalls the tokens of running sequences (SARATHI).
With speculation (engine/speculative/), a decode (1. or 3.) may carry proposed tokens after its
last one; `update` keeps the accepted ones and rolls the rest of its KV back.
A chunk samples only when it reaches the request's last token. With a prefill gate
(engine/slo.py, `EngineConfig.slo_scheduling`), steps 2 and 4 take only the chunks that fit in
the slack of this step's decodes, or whose own TTFT SLO cannot wait; the rest wait their turn.

When blocks run out, the most recently admitted running request is preempted: its blocks are
freed (tail first, so its full blocks stay in the prefix cache longest) and it goes back to the
front of the queue, to be recomputed from its prompt and generated tokens. A request whose
largest possible length does not fit in the whole pool is finished with an error on admission,
so a lone request can always make progress and the scheduler never spins.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.batch import ScheduledBatch, SequenceChunk
from engine.block_pool import BlockPool
from engine.kv_connector import KVConnector
from engine.outputs import SchedulerStats, StepOutput
from engine.prefix_cache import PrefixCache, token_slice
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampler import SamplingRow
from engine.slo import PrefillGate, StepWindow
from engine.speculative.config import SpeculativeConfig
from engine.speculative.proposer import Speculator
from engine.step_costs import StepCosts

if TYPE_CHECKING:
    from engine.speculative.draft import DraftModel


@dataclass
class _StepPlan:
    """The step being filled: request_id -> number of new tokens, in batch order."""

    token_budget: int
    num_new_tokens: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # proposed tokens, when any
    preempted: bool = False
    window: StepWindow | None = None  # the prefill gate's, once the decodes are in


class Scheduler:
    """Owns the requests of one model runtime and the block tables into its pool."""

    def __init__(
        self,
        block_pool: BlockPool,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        seed: int = 0,
        connector: KVConnector | None = None,
        gate: PrefillGate | None = None,
        clock: Callable[[], float] = time.time,
        speculative: SpeculativeConfig | None = None,
        step_costs: StepCosts | None = None,
        release_window: int | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.block_pool = block_pool
        # When every layer slides, the smallest window: a decoding request's blocks wholly
        # before it hold keys no later query reads, so they go back to the pool.
        self.release_window = release_window
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = min(chunk_size, max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = PrefixCache(block_pool, block_size)
        self.connector = connector if connector is not None else KVConnector()
        self.gate = gate
        self.speculator = (
            Speculator(speculative, max_model_len, step_costs, draft)
            if speculative is not None
            else None
        )
        self._clock = clock  # stamps first tokens (time.time(), as arrival times are)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        # Requests whose prompt KV already sits in their own blocks (`add_prefilled`).
        self.landed: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preemption takes from the tail
        self.num_preemptions = 0
        self._rng = random.Random(seed)  # seeds for requests that sample without one
        self._pending: list[StepOutput] = []  # ends (abort, error) reported by the next update

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a prompt that cannot run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}: shorten the prompt so that at least one token can follow"
            )
        if not request.params.greedy and request.params.seed is None:
            # Drawn once here, so recomputing after preemption replays the same draws.
            request.params = replace(request.params, seed=self._rng.getrandbits(63))
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_prefilled(self, request: Request) -> None:
        """Take over a request whose first `num_computed_tokens` tokens already have KV in
        `request.block_table` (blocks this pool allocated; the scheduler now owns that reference).

        It joins the running batch at the next step with room (ahead of waiting prompts: it
        already holds memory). If it is later preempted, it is recomputed like any other request.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        if not 0 < request.num_computed_tokens < request.num_tokens or (
            len(request.block_table) < num_blocks
        ):
            raise ValueError(
                f"request {request.request_id!r}: a prefilled request needs 0 < "
                f"num_computed_tokens ({request.num_computed_tokens}) < num_tokens "
                f"({request.num_tokens}) and {num_blocks} blocks (has {len(request.block_table)})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.landed.append(request)

    def abort(self, request_id: str) -> bool:
        """End a request in any state, freeing its blocks once. False if it is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.landed:
            self.landed.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(StepOutput(request_id, [], True, "abort"))
        return True

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        plan = _StepPlan(token_budget=self.max_num_batched_tokens)
        if self.speculator is not None:
            self.speculator.begin_step(self.running, self.landed)
        self._schedule_running(plan, decodes=True)
        if self.gate is not None:  # this step's decodes, and the landed ones about to join
            decodes = [self.requests[i] for i in plan.num_new_tokens]
            plan.window = self.gate.open(decodes + list(self.landed))
        self._schedule_running(plan, decodes=False)
        if not plan.preempted:  # admitting right after preempting would only thrash
            self._admit_landed(plan)
            self._admit_waiting(plan)
        return self._build_batch(plan)

    def _gate_admits(self, plan: _StepPlan, request: Request, num_new: int) -> bool:
        return plan.window is None or plan.window.admits(request, num_new)

    def _schedule_running(self, plan: _StepPlan, decodes: bool) -> None:
        running = self.running
        i = 0
        while i < len(running) and plan.token_budget > 0:
            request = running[i]
            num_left = request.num_tokens - request.num_computed_tokens
            if (num_left == 1) == decodes:
                num_new = min(num_left, self.chunk_size, plan.token_budget)
                if not decodes and not self._gate_admits(plan, request, num_new):
                    i += 1
                    continue
                draft = self._propose(request, plan.token_budget - num_new, decodes)
                if not self._reserve_blocks(request, num_new + len(draft), plan):
                    return  # it preempted itself: it was the tail, nothing follows
                if draft:
                    plan.drafts[request.request_id] = draft
                    num_new += len(draft)
                plan.num_new_tokens[request.request_id] = num_new
                plan.token_budget -= num_new
            i += 1

    def _reserve_blocks(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        """Give `request` room for `num_new` more tokens, preempting from the tail if needed."""
        block_size = self.block_size
        num_needed = -(-(request.num_computed_tokens + num_new) // block_size) - len(
            request.block_table
        )
        if num_needed <= 0:
            return True
        pool = self.block_pool
        while not pool.can_allocate(num_needed):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        # Grown in place when the next ids are free: a KV hand-off of one run moves with no copy.
        last = request.block_table[-1] if request.block_table else None
        request.block_table.extend(pool.allocate_run(num_needed, after=last))
        return True

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        """Free the tail request's blocks and put it back at the front of the queue."""
        assert self.running[-1] is victim
        self.running.pop()
        num_planned = plan.num_new_tokens.pop(victim.request_id, 0)
        plan.drafts.pop(victim.request_id, None)
        plan.token_budget += num_planned  # it was already scheduled this step: undo that
        self._release_blocks(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        plan.preempted = True

    def _admit_landed(self, plan: _StepPlan) -> None:
        pool = self.block_pool
        held: list[Request] = []  # their grammar still compiles
        while self.landed and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.landed[0]
            if self._waits_for_grammar(request, self.landed, held):
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.token_budget)
            # Its first decode step speculates like any other.
            draft = self._propose(request, plan.token_budget - 1, num_new == 1)
            num_new += len(draft)
            total = request.num_computed_tokens + num_new
            num_needed = max(0, -(-total // self.block_size) - len(request.block_table))
            if not pool.can_allocate(num_needed):
                break
            self.landed.popleft()
            request.block_table.extend(pool.allocate(num_needed))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if draft:
                plan.drafts[request.request_id] = draft
            plan.num_new_tokens[request.request_id] = num_new
            plan.token_budget -= num_new
        self.landed.extendleft(reversed(held))

    def _admit_waiting(self, plan: _StepPlan) -> None:
        pool = self.block_pool
        block_size = self.block_size
        held: list[Request] = []  # the gate's, back at the head of the queue afterwards
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._can_never_fit(request) or self._waits_for_grammar(request, self.waiting, held):
                continue
            # Prompt log-probabilities need every prompt token's logits: no cached prefix.
            want_all = request.wants_prompt_logits
            cached_block_ids = [] if want_all else self.prefix_cache.match(request)
            num_cached = len(cached_block_ids) * block_size
            num_new = min(request.num_tokens - num_cached, self.chunk_size, plan.token_budget)
            num_needed = -(-(num_cached + num_new) // block_size) - len(cached_block_ids)
            # Touching a cached block that nobody holds takes it off the free list too.
            num_revived = sum(1 for b in cached_block_ids if pool.ref_cnt(b) == 0)
            if not pool.can_allocate(num_needed + num_revived):
                self.prefix_cache.forget(request.request_id)
                break  # first come first served: nobody overtakes the head of the queue
            request.num_computed_tokens = num_cached  # what the gate prices the chunk after
            if not self._gate_admits(plan, request, num_new):
                request.num_computed_tokens = 0
                self.prefix_cache.forget(request.request_id)
                held.append(self.waiting.popleft())  # a later prompt may still fit, or be due
                continue
            self.waiting.popleft()
            pool.touch(cached_block_ids)
            last = cached_block_ids[-1] if cached_block_ids else None
            request.block_table = cached_block_ids + pool.allocate_run(num_needed, after=last)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self.prefix_cache.record_admission(request, num_cached)
            request.status = RequestStatus.RUNNING
            if want_all:
                request.prompt_logprobs = [None]  # the first token has no context
            self.running.append(request)
            plan.num_new_tokens[request.request_id] = num_new
            plan.token_budget -= num_new
        self.waiting.extendleft(reversed(held))

    def _propose(self, request: Request, room: int, decodes: bool) -> list[int]:
        if not decodes or self.speculator is None:
            return []
        if not request.params.may_propose:
            return []
        return self.speculator.propose(request, room)

    def _waits_for_grammar(
        self, request: Request, queue: deque[Request], held: list[Request]
    ) -> bool:
        """Take the queue's head out while its grammar compiles (into `held`, to go back at the
        head afterwards), or for good with an error when it does not compile."""
        grammar = request.grammar
        if grammar is None:
            return False
        ready = grammar.ready  # read once: the compile may end between two reads
        if ready and grammar.error is None:
            return False
        queue.popleft()
        if not ready:
            held.append(request)
            return True
        self._finish(request, RequestStatus.FINISHED_ERROR)
        message = f"the structured output does not compile: {grammar.error}"
        self._pending.append(StepOutput(request.request_id, [], True, "error", message))
        return True

    def _can_never_fit(self, request: Request) -> bool:
        """Finish (error) the queue head if even the whole pool cannot hold its longest form."""
        max_new = request.params.max_tokens if request.decodes_here else 1
        max_len = min(request.num_prompt_tokens + max_new, self.max_model_len)
        num_blocks = -(-max_len // self.block_size)
        if num_blocks <= self.block_pool.num_blocks:
            return False
        self.waiting.popleft()
        message = (
            f"request {request.request_id!r} may grow to {max_len} tokens "
            f"({num_blocks} KV blocks), but the pool has only {self.block_pool.num_blocks} "
            f"blocks: lower max_tokens or give the engine more KV cache memory"
        )
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._pending.append(StepOutput(request.request_id, [], True, "error", message))
        return True

    def _build_batch(self, plan: _StepPlan) -> ScheduledBatch:
        chunks: list[SequenceChunk] = []
        requests = self.requests
        drafts = plan.drafts
        for request_id, num_new in plan.num_new_tokens.items():
            request = requests[request_id]
            start = request.num_computed_tokens
            draft = drafts.get(request_id, [])
            end = start + num_new - len(draft)
            chunks.append(
                SequenceChunk(
                    request_id,
                    token_slice(request, start, end) + draft,
                    start,
                    list(request.block_table),
                    end == request.num_tokens,
                    len(draft),
                    request.wants_prompt_logits,
                )
            )
        return ScheduledBatch(chunks)

    # ----------------------------------------------------------------- update
    def sampling_rows(self, batch: ScheduledBatch) -> list[SamplingRow]:
        """What the sampler needs for each sampled chunk of `batch`, in batch order."""
        requests = self.requests
        rows = []
        for chunk in batch.chunks:
            if chunk.sample:
                request = requests[chunk.request_id]
                params = request.params
                row = SamplingRow(params, params.seed or 0, request.num_output_tokens)
                if params.processes_logits:
                    stop_ids = set(params.stop_token_ids)
                    if not params.ignore_eos:
                        stop_ids |= self.eos_token_ids
                    row = replace(
                        row,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids,
                        stop_ids=stop_ids,
                    )
                rows.append(row)
        return rows

    def update(
        self, batch: ScheduledBatch, sampled_token_ids: Sequence[int | Sequence[int]]
    ) -> list[StepOutput]:
        """Record a computed step: per chunk with `sample=True`, in order, its sampled token, or
        for a speculative chunk its new tokens (the accepted proposals, then the target's own)."""
        if len(sampled_token_ids) != batch.num_sampled:
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for "
                f"{batch.num_sampled} sampled chunks"
            )
        outputs, self._pending = self._pending, []
        sampled = iter(sampled_token_ids)
        num_finished = 0
        for chunk in batch.chunks:
            new = next(sampled) if chunk.sample else None
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if new is None:
                request.num_computed_tokens += len(chunk.token_ids)
                self.prefix_cache.register(request)
                self._release_out_of_window(request)
                continue
            new_tokens = [new] if isinstance(new, int) else list(new)
            status = None
            num_kept = 0
            for token_id in new_tokens:  # a stop inside the accepted run ends it there
                request.output_token_ids.append(token_id)
                num_kept += 1
                status = request.stop_status(token_id, self.eos_token_ids, self.max_model_len)
                if status is not None:
                    break
            # KV is valid for the chunk's tokens up to the last kept one's predecessor: the
            # rejected proposals' slots are rolled back (overwritten by later steps).
            request.num_computed_tokens = chunk.context_len - chunk.num_draft - 1 + num_kept
            if chunk.num_draft:
                self._observe_speculation(request, chunk.num_draft, len(new_tokens) - 1)
            self.prefix_cache.register(request)
            self._release_out_of_window(request)
            if request.first_token_at is None:
                request.first_token_at = self._clock()
            kept = new_tokens[:num_kept]
            if status is None and not request.decodes_here:
                if self.connector.hand_off(request):  # it holds the blocks from here on
                    status = RequestStatus.FINISHED_HANDED_OFF
            if status is None:
                outputs.append(StepOutput(request.request_id, kept))
            else:
                self._finish(request, status)
                num_finished += 1
                handed_off = status == RequestStatus.FINISHED_HANDED_OFF
                outputs.append(
                    StepOutput(
                        request.request_id,
                        kept,
                        True,
                        FINISH_REASONS.get(status),
                        handed_off=handed_off,
                        num_spec_proposed=request.spec.num_proposed if request.spec else 0,
                        num_spec_accepted=request.spec.num_accepted if request.spec else 0,
                    )
                )
        if num_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _observe_speculation(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Count the verification, adapt the request's proposal length, and free the blocks
        that only rejected proposals reached (the next token's block stays)."""
        assert self.speculator is not None
        self.speculator.observe(request, num_proposed, num_accepted)
        num_keep = -(-request.num_tokens // self.block_size)
        if len(request.block_table) > num_keep:
            surplus = request.block_table[num_keep:]
            del request.block_table[num_keep:]
            self.block_pool.free_sequence_blocks(surplus)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release its blocks; the caller takes it out of running/waiting."""
        request.status = status
        if status != RequestStatus.FINISHED_HANDED_OFF:
            self.connector.request_finished(request)
        self._release_blocks(request)
        del self.requests[request.request_id]

    def _release_out_of_window(self, request: Request) -> None:
        """Give back the blocks wholly before every layer's window. The next query sits at
        position >= num_computed_tokens and reads keys from num_computed_tokens - W + 1 on, as
        the attention backends cut their tables. Only where the request decodes here: a hand-off
        ships the whole table. Released entries repeat the first kept block's id, so the table
        stays indexed by position and a backend that masks rather than skips reads its own block.
        """
        window = self.release_window
        if window is None or not request.decodes_here:
            return
        table = request.block_table
        num_out = min((request.num_computed_tokens - window + 1) // self.block_size, len(table) - 1)
        done = request.num_released_blocks
        if num_out <= done:
            return
        # registered in the prefix cache already (`register` runs first): they stay findable
        self.block_pool.free_sequence_blocks(table[done:num_out])
        table[:num_out] = [table[num_out]] * num_out
        request.num_released_blocks = num_out

    def _release_blocks(self, request: Request) -> None:
        if self.speculator is not None:  # a draft model's blocks go with the target's
            self.speculator.release(request)
        self.block_pool.free_sequence_blocks(request.block_table[request.num_released_blocks :])
        request.block_table = []
        request.num_released_blocks = 0
        request.num_computed_tokens = 0
        self.prefix_cache.forget(request.request_id)

    # ---------------------------------------------------------------- queries
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.landed),
            num_free_blocks=self.block_pool.num_free_blocks,
            num_total_blocks=self.block_pool.num_blocks,
            num_prefix_hit_tokens=self.prefix_cache.num_hit_tokens,
            num_prefix_queried_tokens=self.prefix_cache.num_queried_tokens,
            num_preemptions=self.num_preemptions,
            num_queued_prompt_tokens=sum(r.num_tokens for r in self.waiting),
            num_decoding=sum(1 for r in self.running if r.num_output_tokens),
            num_spec_proposed=self.speculator.num_proposed if self.speculator else 0,
            num_spec_accepted=self.speculator.num_accepted if self.speculator else 0,
        )
