"""Control messages between process-hosted workers (deploy/runtime/local/control_relay.py) keep flowing when a
worker is SIGKILLed in the middle of sending them, when a message cannot be read, and when one
addressee is too slow to take its messages. Real child processes (ProcessWorker)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from deploy.runtime.local.control_relay import ControlRelay
from deploy.runtime.local.process_host import PipeControl, ProcessWorker

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

BIG = 1 << 20  # a message that takes a while to write: a kill lands mid-write or mid-lock


class Unreadable:
    """Pickles, but cannot be unpickled (the relay must log it and go on)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_refuse, ("this message cannot be read",))


def _refuse(reason: str) -> None:
    raise ValueError(reason)


class Peer:
    """A worker stand-in: sends control messages, and counts those delivered to it."""

    def __init__(self, instance_id: str, send_control: PipeControl) -> None:
        self.instance_id = instance_id
        self.send_control = send_control
        self.received: list[str] = []
        self.lock = threading.Lock()
        self.hold_s = 0.0

    def deliver(self, message: Any) -> None:
        time.sleep(self.hold_s)  # a slow peer
        with self.lock:
            self.received.append(message if isinstance(message, str) else "big")

    def set_hold(self, seconds: float) -> None:
        self.hold_s = seconds

    def received_from(self, prefix: str) -> int:
        with self.lock:
            return sum(1 for message in self.received if message.startswith(prefix))

    def send(self, to: str, prefix: str, count: int) -> None:
        for n in range(count):
            self.send_control(to, f"{prefix}{n}")

    def send_unreadable(self, to: str) -> None:
        self.send_control(to, Unreadable())

    def flood(self, to: str) -> None:
        """Big messages from a few threads, without end (until the process is killed)."""

        def loop() -> None:
            while True:
                self.send_control(to, b"x" * BIG)

        for _ in range(3):
            threading.Thread(target=loop, daemon=True).start()


# Calls on a Peer across its pipe: typed commands, as worker/protocol.py's are for workers.
@dataclass(frozen=True)
class Send:
    to: str
    prefix: str
    count: int

    def run(self, peer: Peer) -> None:
        peer.send(self.to, self.prefix, self.count)


@dataclass(frozen=True)
class SendUnreadable:
    to: str

    def run(self, peer: Peer) -> None:
        peer.send_unreadable(self.to)


@dataclass(frozen=True)
class SetHold:
    seconds: float

    def run(self, peer: Peer) -> None:
        peer.set_hold(self.seconds)


@dataclass(frozen=True)
class ReceivedFrom:
    prefix: str

    def run(self, peer: Peer) -> int:
        return peer.received_from(self.prefix)


@dataclass(frozen=True)
class Flood:
    to: str

    def run(self, peer: Peer) -> None:
        peer.flood(self.to)


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[ControlRelay, dict[str, ProcessWorker]]]:
    """Three peers for the module (each process imports torch: slow on 2 cores); the last test
    kills "c"."""
    workers: dict[str, ProcessWorker] = {}
    relay = ControlRelay(workers, call_timeout_s=10.0)
    try:
        with ThreadPoolExecutor(3) as pool:
            started = pool.map(
                lambda name: ProcessWorker(Peer, name, relay.sender(), name=name), "abc"
            )
            workers.update(zip("abc", started, strict=True))
        yield relay, workers
    finally:
        for worker in workers.values():
            worker.kill()
        relay.stop()


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def test_an_unreadable_message_is_logged_and_the_next_ones_arrive(
    peers: tuple[ControlRelay, dict[str, ProcessWorker]],
) -> None:
    relay, workers = peers
    num_failed = relay.num_failed
    workers["b"].call(SendUnreadable("a"))
    workers["b"].call(Send("a", "after-", 5))
    _wait_for(lambda: workers["a"].call(ReceivedFrom("after-")) == 5, 10, "later messages")
    assert relay.num_failed == num_failed + 1


def test_a_slow_peer_does_not_hold_up_messages_to_the_others(
    peers: tuple[ControlRelay, dict[str, ProcessWorker]],
) -> None:
    _relay, workers = peers
    workers["a"].call(SetHold(2.0))
    workers["c"].call(Send("a", "slow-", 5))  # 10 s of delivery to a
    workers["c"].call(Send("b", "fast-", 5))
    _wait_for(lambda: workers["b"].call(ReceivedFrom("fast-")) == 5, 3, "b's messages")
    workers["a"].call(SetHold(0.0))


def test_messages_queued_for_a_busy_peer_reach_it_together(
    peers: tuple[ControlRelay, dict[str, ProcessWorker]],
) -> None:
    """A prefill busy in a step took one ack per step when the relay waited for each delivery:
    under load the acks lagged by seconds, and the blocks they free stayed held."""
    _relay, workers = peers
    workers["a"].call(SetHold(0.5))
    try:
        workers["b"].call(Send("a", "batch-", 10))  # 5 s one at a time
        _wait_for(lambda: workers["a"].call(ReceivedFrom("batch-")) == 10, 3, "the batch")
    finally:
        workers["a"].call(SetHold(0.0))


def test_a_worker_killed_while_sending_does_not_stop_the_others_messages(
    peers: tuple[ControlRelay, dict[str, ProcessWorker]],
) -> None:
    _relay, workers = peers
    workers["c"].call(Flood("nobody"))  # big messages, to an instance that does not exist
    time.sleep(1.0)
    os.kill(workers["c"].pid, signal.SIGKILL)  # most likely mid-write
    for round_ in range(3):  # and it keeps flowing
        workers["b"].call(Send("a", f"r{round_}-", 20))
        prefix = f"r{round_}-"
        _wait_for(lambda p=prefix: workers["a"].call(ReceivedFrom(p)) == 20, 10, "b's messages")
