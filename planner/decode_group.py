"""The decode side of one instance: requests that hold KV, stepping together in groups.

A group is a micro-batch that steps as one: every member gains one token per step. Keeping
running sums makes a step O(1) whatever the batch size, and a member costs O(log n) when it
joins, finishes or is preempted, so 10,000 requests simulate in well under a second:

    Σctx(group) = base + n * counter        base = Σ(ctx at join - counter at join)
    a member finishes when counter reaches its key in `finish` (a heap)

With pipeline parallelism several groups are in flight; each comes back to the first stage and
is merged there with the others waiting (as DistServe's cyclic stage queues do).
Entries of the two heaps carry the request's epoch: one whose epoch moved on (finished,
preempted) is stale and skipped when it surfaces.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Group:
    counter: int = 0
    n: int = 0
    base: int = 0
    finish: list[tuple[int, int, int]] = field(default_factory=list)  # (counter, rid, epoch)
    members: list[tuple[int, int, int]] = field(default_factory=list)  # (-admit seq, rid, epoch)
    # Members whose KV still grows (all, unless the model's window caps it), and when each stops.
    growing: int = 0
    capped: list[tuple[int, int, int]] = field(default_factory=list)  # (counter, rid, epoch)

    @property
    def sum_ctx(self) -> int:
        return self.base + self.n * self.counter


class RequestTable:
    """Per-request state in flat lists (index = request id)."""

    def __init__(self, prompt_lens: list[int], decode_steps: list[int]) -> None:
        num = len(prompt_lens)
        self.prompt = prompt_lens
        self.steps = decode_steps  # decode steps each request needs after its prefill
        self.done = [0] * num  # decode steps done when it last joined a group
        self.join_counter = [0] * num
        self.join_ctx = [0] * num
        self.held = [0] * num  # KV tokens already counted against memory before joining
        self.epoch = [0] * num
        self.recompute = [False] * num
        self.first_ms = [math.nan] * num
        self.last_ms = [math.nan] * num


class DecodeSide:
    """KV memory and the groups of one instance. `capacity` in tokens (None: unlimited).
    `window`: the most KV tokens a request keeps once decoding (a model whose every layer
    slides gives back the rest); a request lands with its whole context, then shrinks to it."""

    def __init__(
        self,
        table: RequestTable,
        capacity: int | None,
        max_seqs: int | None,
        window: int | None = None,
    ) -> None:
        self.table = table
        self.capacity = math.inf if capacity is None else capacity
        self.window = math.inf if window is None else window
        self.max_seqs = max_seqs or 1 << 60
        self.waiting: deque[int] = deque()  # KV is here (or must be recomputed); not stepping
        self.ready: list[Group] = []  # groups back at the first stage
        self.used = 0  # KV tokens in use
        self.num_stepping = 0  # members of every group, in flight or ready
        self.num_preemptions = 0
        self._admit_seq = 0

    def load(self) -> int:
        return len(self.waiting) + self.num_stepping

    def has_work(self) -> bool:
        return bool(self.ready or self.waiting)

    # ------------------------------------------------------------------ forming a step
    def form(self) -> tuple[Group, int, int]:
        """The group for the next step: ready groups merged, waiting requests admitted while
        memory allows, members preempted (latest admitted first) until one more token each
        fits. Returns (group, recomputed tokens, Σ recomputed²) for the caller to price."""
        group = self._merge_ready()
        recomputed, recomputed_sq = self._admit(group)
        self._preempt_for_growth(group)
        self.used += group.growing  # each growing member's next token
        return group, recomputed, recomputed_sq

    def _merge_ready(self) -> Group:
        if not self.ready:
            return Group()
        self.ready.sort(key=lambda g: g.n, reverse=True)
        group = self.ready[0]
        for other in self.ready[1:]:
            self._merge_into(group, other)
        self.ready = []
        return group

    def _merge_into(self, group: Group, other: Group) -> None:
        table, delta = self.table, group.counter - other.counter
        for key, rid, epoch in other.finish:
            if table.epoch[rid] == epoch:
                table.join_counter[rid] += delta
                heapq.heappush(group.finish, (key + delta, rid, epoch))
        for entry in other.members:
            if table.epoch[entry[1]] == entry[2]:
                heapq.heappush(group.members, entry)
        for key, rid, epoch in other.capped:
            if table.epoch[rid] == epoch:
                heapq.heappush(group.capped, (key + delta, rid, epoch))
        group.base += other.base - other.n * delta
        group.n += other.n
        group.growing += other.growing

    def _admit(self, group: Group) -> tuple[int, int]:
        table = self.table
        recomputed = recomputed_sq = 0
        while self.waiting and self.num_stepping < self.max_seqs:
            rid = self.waiting[0]
            ctx = table.prompt[rid] + table.done[rid]
            extra = ctx - table.held[rid]
            lone = self.num_stepping == 0
            if self.used + extra + 1 > self.capacity and not lone:
                break
            self.waiting.popleft()
            self.used += int(min(ctx, self.window)) - table.held[rid]
            table.held[rid] = 0
            if table.recompute[rid]:
                table.recompute[rid] = False
                recomputed += ctx
                recomputed_sq += ctx * ctx
            self._join(group, rid, ctx)
        return recomputed, recomputed_sq

    def _join(self, group: Group, rid: int, ctx: int) -> None:
        table = self.table
        table.join_counter[rid] = group.counter
        table.join_ctx[rid] = ctx
        group.base += ctx - group.counter
        group.n += 1
        self.num_stepping += 1
        epoch = table.epoch[rid]
        remaining = table.steps[rid] - table.done[rid]
        heapq.heappush(group.finish, (group.counter + remaining, rid, epoch))
        self._admit_seq += 1
        heapq.heappush(group.members, (-self._admit_seq, rid, epoch))
        if ctx < self.window:
            group.growing += 1
            if self.window != math.inf:
                stop = group.counter + int(self.window - ctx)
                heapq.heappush(group.capped, (stop, rid, epoch))

    def _leave(self, group: Group, rid: int) -> int:
        """Take `rid` out of `group`; returns the KV tokens it held."""
        table = self.table
        steps_here = group.counter - table.join_counter[rid]
        table.done[rid] += steps_here
        group.n -= 1
        group.base -= table.join_ctx[rid] - table.join_counter[rid]
        self.num_stepping -= 1
        table.epoch[rid] += 1
        ctx = table.join_ctx[rid] + steps_here
        if ctx < self.window:
            group.growing -= 1
        return int(min(ctx, self.window))

    def _preempt_for_growth(self, group: Group) -> None:
        table = self.table
        while group.n > 1 and self.used + group.growing > self.capacity:
            _, rid, epoch = heapq.heappop(group.members)
            if table.epoch[rid] != epoch:
                continue
            self.used -= self._leave(group, rid)
            table.recompute[rid] = True
            self.waiting.appendleft(rid)
            self.num_preemptions += 1

    # ------------------------------------------------------------------ a step ended
    def advance(self, group: Group, now_ms: float) -> list[int]:
        """The group's step ended at `now_ms`: finished members leave and free their KV.
        The group goes back to the first stage when any member is left."""
        table = self.table
        group.counter += 1
        capped = group.capped
        while capped and capped[0][0] <= group.counter:
            _, rid, epoch = heapq.heappop(capped)
            if table.epoch[rid] == epoch:
                group.growing -= 1
        finished = []
        heap = group.finish
        while heap and heap[0][0] <= group.counter:
            _, rid, epoch = heapq.heappop(heap)
            if table.epoch[rid] != epoch:
                continue
            self.used -= self._leave(group, rid)
            table.last_ms[rid] = now_ms
            finished.append(rid)
        if group.n:
            self.ready.append(group)
        return finished
