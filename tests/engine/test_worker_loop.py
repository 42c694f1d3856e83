"""WorkerLoop: commands run on the loop thread between steps; events come out in order; a crashed
step makes the worker unhealthy and every later call a WorkerUnavailable, never a hang."""

from __future__ import annotations

import threading
import time

import pytest

from worker.loop import WorkerLoop
from worker.protocol import TokenEvent, WorkerUnavailable


class Counter(WorkerLoop):
    """Emits one token per step for each queued request until it has `n` tokens."""

    def __init__(self) -> None:
        super().__init__("counter-0")
        self.todo: dict[str, int] = {}
        self.loop_thread_ids: set[int] = set()
        self.crash_on_step = False

    def add(self, request_id: str, n: int) -> None:
        self.call(lambda: self.todo.__setitem__(request_id, n))

    def step(self) -> bool:
        self.loop_thread_ids.add(threading.get_ident())
        if self.crash_on_step:
            raise RuntimeError("boom")
        if not self.todo:
            return False
        events = []
        for rid in list(self.todo):
            self.todo[rid] -= 1
            done = self.todo[rid] == 0
            events.append(TokenEvent(rid, [self.todo[rid]], "length" if done else None))
            if done:
                del self.todo[rid]
        self._emit(events)
        return True

    def fail_all(self, message: str) -> None:
        self._emit([TokenEvent(rid, [], "error", message) for rid in self.todo])


def collect(worker: Counter, num_finished: int, timeout_s: float = 5.0) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    deadline = time.monotonic() + timeout_s
    while sum(e.finish_reason is not None for e in events) < num_finished:
        assert time.monotonic() < deadline, f"only got {events}"
        events += worker.poll_events(0.5)
    return events


def test_commands_and_steps_share_one_thread_and_events_arrive_in_order() -> None:
    worker = Counter()
    worker.start()
    try:
        worker.add("a", 3)
        worker.add("b", 1)
        events = collect(worker, 2)
        assert [e.token_ids[0] for e in events if e.request_id == "a"] == [2, 1, 0]
        assert [e.finish_reason for e in events if e.request_id == "b"] == ["length"]
        assert len(worker.loop_thread_ids) == 1
        assert threading.get_ident() not in worker.loop_thread_ids
        assert worker.call(lambda: 41 + 1) == 42
        with pytest.raises(KeyError):
            worker.call(lambda: {}["missing"])  # the command's own error reaches the caller
        assert worker.healthy
    finally:
        worker.stop()


def test_a_crashing_step_fails_requests_and_later_calls() -> None:
    worker = Counter()
    worker.start()
    try:

        def add_then_crash() -> None:
            worker.todo["a"] = 100
            worker.crash_on_step = True

        worker.call(add_then_crash)
        events = collect(worker, 1)
        assert events[-1].finish_reason == "error" and "boom" in (events[-1].error or "")
        assert not worker.healthy
        with pytest.raises(WorkerUnavailable, match="boom"):
            worker.call(lambda: 1)
    finally:
        worker.stop()


def test_poll_events_waits_at_most_its_timeout() -> None:
    worker = Counter()
    worker.start()
    try:
        start = time.monotonic()
        assert worker.poll_events(0.2) == []
        assert 0.15 < time.monotonic() - start < 2.0
    finally:
        worker.stop()


class IdleCounter(Counter):
    """A Counter that says when it has nothing in flight; counts its idle wake-ups."""

    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0

    def step(self) -> bool:
        self.num_steps += 1
        return super().step()

    def busy(self) -> bool:
        return bool(self.todo)


def test_an_idle_loop_sleeps_until_a_command_or_its_liveness_check() -> None:
    """Idle with nothing in flight, the loop wakes for its liveness checks (4 a second), not
    every 5 ms; a command still runs at once, and work after it is stepped as before."""
    worker = IdleCounter()
    worker.start()
    try:
        time.sleep(1.0)
        idle_steps = worker.call(lambda: worker.num_steps)
        assert idle_steps <= 12, idle_steps  # polling every 5 ms would be about 200
        started = time.monotonic()
        worker.add("a", 3)
        assert [e.token_ids[0] for e in collect(worker, 1)] == [2, 1, 0]
        assert time.monotonic() - started < 0.2  # woken by the command, not the next check
    finally:
        worker.stop()
