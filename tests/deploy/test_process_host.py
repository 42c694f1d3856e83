"""ProcessWorker: a worker object in a real child process; calls, concurrent long polls, remote
errors, and a killed child turning calls into WorkerUnavailable within their timeout."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import pytest

from deploy.runtime.local.process_host import ProcessWorker
from worker.protocol import WorkerUnavailable

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers


class Echo:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.released = threading.Event()

    def hello(self, name: str) -> str:
        return f"{self.prefix} {name} from {os.getpid()}"

    def block_until_released(self, timeout_s: float) -> bool:
        return self.released.wait(timeout_s)

    def release(self) -> None:
        self.released.set()

    def fail(self) -> None:
        raise ValueError("bad value: 7")


# Calls on an Echo across the pipe: typed commands, as worker/protocol.py's are for workers.
@dataclass(frozen=True)
class Hello:
    name: str

    def run(self, echo: Echo) -> str:
        return echo.hello(self.name)


@dataclass(frozen=True)
class BlockUntilReleased:
    timeout_s: float

    def run(self, echo: Echo) -> bool:
        return echo.block_until_released(self.timeout_s)


class Release:
    def run(self, echo: Echo) -> None:
        echo.release()


class Fail:
    def run(self, echo: Echo) -> None:
        echo.fail()


def test_calls_run_in_the_child_and_do_not_block_each_other() -> None:
    worker = ProcessWorker(Echo, "hi", name="echo")
    try:
        assert worker.pid != os.getpid()
        assert worker.call(Hello("ann")) == f"hi ann from {worker.pid}"
        results: list[bool] = []
        poller = threading.Thread(
            target=lambda: results.append(worker.call(BlockUntilReleased(10.0), timeout_s=15))
        )
        poller.start()
        time.sleep(0.2)
        worker.call(Release())  # served while the long call is still waiting
        poller.join(15)
        assert results == [True]
        with pytest.raises(ValueError, match="bad value: 7"):
            worker.call(Fail())
    finally:
        worker.shutdown()
    assert not worker.is_alive()


def test_a_killed_child_fails_pending_and_later_calls() -> None:
    worker = ProcessWorker(Echo, "hi", name="echo")
    errors: list[BaseException] = []

    def long_call() -> None:
        try:
            worker.call(BlockUntilReleased(30.0), timeout_s=20)
        except BaseException as exc:
            errors.append(exc)

    poller = threading.Thread(target=long_call)
    poller.start()
    time.sleep(0.3)
    start = time.monotonic()
    os.kill(worker.pid, 9)
    poller.join(10)
    assert isinstance(errors[0], WorkerUnavailable)
    assert time.monotonic() - start < 5
    with pytest.raises(WorkerUnavailable):
        worker.call(Hello("x"))
    worker.shutdown()
