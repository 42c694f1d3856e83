"""Admission control: a bounded number of running requests and a bounded FIFO queue before them.

    try_admit(deadline_s)  ->  running (a slot is free)  |  waiting (queue has room)  |  AdmissionFull
    wait_until_running(ticket)   FIFO; a cancelled waiter leaves the queue
    park(ticket) / resume(ticket)   a running request the workers had no KV space for gives up
                                 its slot and waits in a queue place; resumed, it runs again
                                 ahead of the FIFO
    release(ticket)              frees the slot (or the queue place) and starts the next waiter

Past both bounds a request is refused at once (the router answers RESOURCE_EXHAUSTED), so a
burst can never grow an unbounded backlog. A request whose deadline would pass before its turn
comes (the queue ahead of it, at the rate waiters have been starting) is refused at once too,
rather than left to time out in the queue. Single event loop, no locks: every method runs on it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

_RATE_SMOOTHING = 0.2  # weight of the newest interval between two waiters' starts


class AdmissionFull(Exception):
    """No running slot and no queue place left."""


class AdmissionTicket:
    __slots__ = ("_future", "holds_place", "parked", "released", "running")

    def __init__(self, running: bool, future: asyncio.Future[None] | None = None) -> None:
        self.running = running
        self.parked = False  # waiting for KV space, in a queue place
        # Back from a park and trying to place again: it keeps its queue place until it is
        # placed (settle), parks again, or ends, so no later arrival takes the place meanwhile.
        self.holds_place = False
        self.released = False
        self._future = future


class AdmissionController:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.num_running = 0
        self._waiting: deque[AdmissionTicket] = deque()
        self._num_parked = 0
        self._num_holding = 0  # resumed tickets keeping their queue place (holds_place)
        self.num_parks_total = 0  # times a running request gave up its slot for KV space
        self._start_interval_s: float | None = None  # smoothed time between waiters' starts
        self._last_start: float | None = None

    @property
    def num_waiting(self) -> int:
        """Requests in queue places: waiting for a running slot, or parked for KV space."""
        return len(self._waiting) + self._num_parked + self._num_holding

    def expected_wait_s(self) -> float | None:
        """How long a request queued now would wait for its turn (None: no estimate yet)."""
        if self._start_interval_s is None:
            return None
        return (len(self._waiting) + 1) * self._start_interval_s

    def try_admit(self, deadline_s: float | None = None) -> AdmissionTicket:
        """`deadline_s`: the time the caller has left (None: no deadline)."""
        if self.num_running < self.max_running and not self._waiting:
            self.num_running += 1
            return AdmissionTicket(running=True)
        if self.num_waiting >= self.max_queued:
            raise AdmissionFull(self._full_message())
        wait_s = self.expected_wait_s()
        if deadline_s is not None and wait_s is not None and wait_s > deadline_s:
            raise AdmissionFull(
                f"the router is at capacity: {len(self._waiting)} requests queued ahead would "
                f"take about {wait_s:.1f}s, past this request's deadline ({deadline_s:.1f}s "
                "left); retry later, or with a longer deadline"
            )
        ticket = AdmissionTicket(running=False, future=asyncio.get_running_loop().create_future())
        self._waiting.append(ticket)
        return ticket

    async def wait_until_running(self, ticket: AdmissionTicket) -> None:
        if ticket.running:
            return
        assert ticket._future is not None
        await ticket._future  # a cancel here propagates; release() cleans up the ticket

    def park(self, ticket: AdmissionTicket) -> None:
        """A running request waits for KV space: its running slot goes to the next waiter and it
        takes a queue place instead. Raises AdmissionFull when no queue place is left."""
        assert ticket.running and not ticket.released
        if ticket.holds_place:  # parks again in the place it kept
            ticket.holds_place = False
            self._num_holding -= 1
        elif self.num_waiting >= self.max_queued:
            raise AdmissionFull(self._full_message())
        ticket.running, ticket.parked = False, True
        self._num_parked += 1
        self.num_parks_total += 1
        self.num_running -= 1
        self._start_waiters()

    async def resume(self, ticket: AdmissionTicket) -> None:
        """A parked request runs again: at once if a slot is free, else first in the queue
        (it waited longer than anyone queued behind it)."""
        assert ticket.parked
        ticket.parked = False
        self._num_parked -= 1
        if self.num_running < self.max_running:
            ticket.running = True
            self.num_running += 1
        else:
            ticket._future = asyncio.get_running_loop().create_future()
            self._waiting.appendleft(ticket)  # a queue place of its own meanwhile
            await self.wait_until_running(ticket)
        if not ticket.released:
            ticket.holds_place = True
            self._num_holding += 1

    def settle(self, ticket: AdmissionTicket) -> None:
        """The request is placed: a place it kept since a park is free again."""
        if ticket.holds_place:
            ticket.holds_place = False
            self._num_holding -= 1

    def _full_message(self) -> str:
        return (
            f"the router is at capacity ({self.num_running} requests running, "
            f"{self.num_waiting} queued); retry later"
        )

    def release(self, ticket: AdmissionTicket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.settle(ticket)
        if ticket.parked:
            ticket.parked = False
            self._num_parked -= 1
            return
        if not ticket.running:
            self._waiting.remove(ticket)
            return
        self.num_running -= 1
        self._start_waiters()

    def _start_waiters(self) -> None:
        while self._waiting and self.num_running < self.max_running:
            self._note_start(time.monotonic())
            ticket = self._waiting.popleft()
            ticket.running = True
            self.num_running += 1
            assert ticket._future is not None
            if not ticket._future.done():
                ticket._future.set_result(None)

    def _note_start(self, now: float) -> None:
        """Track the rate at which the queue drains. An interval counts only while the queue was
        not empty at both starts, so an idle spell is not taken for a slow drain."""
        if self._last_start is not None:
            interval = now - self._last_start
            previous = self._start_interval_s
            self._start_interval_s = (
                interval
                if previous is None
                else (1 - _RATE_SMOOTHING) * previous + _RATE_SMOOTHING * interval
            )
        self._last_start = now if len(self._waiting) > 1 else None
