"""Admission refuses at once a request whose deadline would pass in the queue, judged by the rate
the queue has been draining; without a deadline, or with time enough, it queues as before. (A
one-token probe with a 10 s deadline timed out in the queue of a 1,500-stream burst while health
said SERVING: refusing it at once says what is true, that the router is at capacity.)"""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionController, AdmissionFull


async def _scenario() -> None:
    admission = AdmissionController(max_running=1, max_queued=10)
    running = admission.try_admit()
    assert admission.expected_wait_s() is None  # no drain seen yet: no estimate, no refusal
    queued = [admission.try_admit(deadline_s=0.001) for _ in range(4)]
    # The queue drains one request per ~50 ms: each release starts the next waiter.
    for ticket in [running, *queued[:2]]:
        await asyncio.sleep(0.05)
        admission.release(ticket)
    await admission.wait_until_running(queued[2])
    wait_s = admission.expected_wait_s()
    assert wait_s is not None and 0.05 < wait_s < 1.0, wait_s  # 1 ahead + this one, ~50 ms each
    with pytest.raises(AdmissionFull, match="past this request's deadline"):
        admission.try_admit(deadline_s=0.01)
    assert admission.num_waiting == 1  # the refused request left nothing behind
    roomy = admission.try_admit(deadline_s=30.0)
    no_deadline = admission.try_admit()
    assert not roomy.running and not no_deadline.running
    assert admission.num_waiting == 3


def test_a_request_that_would_outwait_its_deadline_is_refused_at_once() -> None:
    asyncio.run(_scenario())
