"""DistServe's decode worker, as its simulator models it: one FIFO and a token cap per step.

Every step takes requests from the head of the queue while their Σ(ctx + 1) fits the cap
(50,000 tokens in DistServe's simulator, whatever the GPU memory); the rest wait. After the step
its members go back to the tail, behind the requests that arrived during the step, so a
queue longer than the cap is served round robin. There is no KV-memory limit and no preemption.

It has the interface of planner/decode_group.DecodeSide that the simulator uses (`waiting`,
`load`, `has_work`, `form`, `advance`), so either can serve a decode or colocated instance.
A step costs O(batch) here, as in DistServe's own simulator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from planner.decode_group import RequestTable

# The cap DistServe's simulator applies to a decode step (Σ(ctx + 1) over the batch).
DISTSERVE_DECODE_BATCH_TOKENS = 50_000


@dataclass
class FifoBatch:
    """The requests of one decode step and their context sum."""

    members: list[int] = field(default_factory=list)
    sum_ctx: int = 0

    @property
    def n(self) -> int:
        return len(self.members)


class FifoDecodeSide:
    """The decode queue of one instance under DistServe's per-step token cap."""

    def __init__(self, table: RequestTable, batch_tokens: int) -> None:
        if batch_tokens < 1:
            raise ValueError(f"the decode batch token cap must be >= 1, got {batch_tokens}")
        self.table = table
        self.batch_tokens = batch_tokens
        self.waiting: deque[int] = deque()  # FIFO; new KV and finished steps join the tail
        self.num_stepping = 0
        self.num_preemptions = 0  # never: this model has no memory limit

    def load(self) -> int:
        return len(self.waiting) + self.num_stepping

    def has_work(self) -> bool:
        return bool(self.waiting)

    def form(self) -> tuple[FifoBatch, int, int]:
        """The head of the queue while Σ(ctx + 1) fits; (batch, 0, 0) as DecodeSide.form."""
        table, batch, budget = self.table, FifoBatch(), self.batch_tokens
        while self.waiting:
            rid = self.waiting[0]
            ctx = table.prompt[rid] + table.done[rid]
            if ctx + 1 > budget and batch.members:
                break
            budget -= ctx + 1
            batch.sum_ctx += ctx
            batch.members.append(self.waiting.popleft())
        self.num_stepping += batch.n
        return batch, 0, 0

    def advance(self, batch: FifoBatch, now_ms: float) -> list[int]:
        """The step ended at `now_ms`: each member gained a token; finished ones leave."""
        table, finished = self.table, []
        for rid in batch.members:
            table.done[rid] += 1
            if table.done[rid] >= table.steps[rid]:
                table.last_ms[rid] = now_ms
                finished.append(rid)
            else:
                self.waiting.append(rid)
        self.num_stepping -= batch.n
        return finished
