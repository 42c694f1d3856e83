"""Admission control: a bounded number of running requests and a bounded FIFO queue before them.

    try_admit()  ->  running (a slot is free)  |  waiting (queue has room)  |  AdmissionFull
    wait_until_running(ticket)   FIFO; a cancelled waiter leaves the queue
    release(ticket)              frees the slot (or the queue place) and starts the next waiter

Past both bounds a request is refused at once (the router answers RESOURCE_EXHAUSTED), so a
burst can never grow an unbounded backlog. Single event loop, no locks: every method runs on it.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionFull(Exception):
    """No running slot and no queue place left."""


class AdmissionTicket:
    __slots__ = ("_future", "released", "running")

    def __init__(self, running: bool, future: asyncio.Future[None] | None = None) -> None:
        self.running = running
        self.released = False
        self._future = future


class AdmissionController:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.num_running = 0
        self._waiting: deque[AdmissionTicket] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def try_admit(self) -> AdmissionTicket:
        if self.num_running < self.max_running and not self._waiting:
            self.num_running += 1
            return AdmissionTicket(running=True)
        if len(self._waiting) >= self.max_queued:
            raise AdmissionFull(
                f"the router is at capacity ({self.num_running} requests running, "
                f"{len(self._waiting)} queued); retry later"
            )
        ticket = AdmissionTicket(running=False, future=asyncio.get_running_loop().create_future())
        self._waiting.append(ticket)
        return ticket

    async def wait_until_running(self, ticket: AdmissionTicket) -> None:
        if ticket.running:
            return
        assert ticket._future is not None
        await ticket._future  # a cancel here propagates; release() cleans up the ticket

    def release(self, ticket: AdmissionTicket) -> None:
        if ticket.released:
            return
        ticket.released = True
        if not ticket.running:
            self._waiting.remove(ticket)
            return
        self.num_running -= 1
        self._start_waiters()

    def _start_waiters(self) -> None:
        while self._waiting and self.num_running < self.max_running:
            ticket = self._waiting.popleft()
            ticket.running = True
            self.num_running += 1
            assert ticket._future is not None
            if not ticket._future.done():
                ticket._future.set_result(None)
