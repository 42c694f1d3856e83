"""A request parked for KV space keeps its queue place while it tries to place again: a request
that arrives meanwhile gets no place it could take from it (it is refused, as it would have been
a moment earlier), and the parked one parks again in its own place. The place frees once the
request is placed (settle) or ends (release)."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionController, AdmissionFull


def test_a_place_is_kept_through_a_retry_and_freed_once_placed() -> None:
    async def run() -> None:
        admission = AdmissionController(max_running=8, max_queued=1)
        first, second = admission.try_admit(), admission.try_admit()
        admission.park(first)  # no KV space: it takes the one queue place
        with pytest.raises(AdmissionFull):
            admission.park(second)
        await admission.resume(first)  # it tries to place again...
        assert admission.num_waiting == 1
        with pytest.raises(AdmissionFull):  # ...and its place is still its own
            admission.park(second)
        admission.park(first)  # refused again: back in the same place
        assert admission.num_waiting == 1
        await admission.resume(first)
        admission.settle(first)  # placed: the place is free
        assert admission.num_waiting == 0
        admission.park(second)
        assert admission.num_waiting == 1
        for ticket in (first, second):
            admission.release(ticket)
        assert (admission.num_waiting, admission.num_running) == (0, 0)

    asyncio.run(run())


def test_a_request_that_ends_while_retrying_frees_its_place() -> None:
    async def run() -> None:
        admission = AdmissionController(max_running=8, max_queued=1)
        ticket = admission.try_admit()
        admission.park(ticket)
        await admission.resume(ticket)
        admission.release(ticket)
        assert (admission.num_waiting, admission.num_running) == (0, 0)

    asyncio.run(run())
