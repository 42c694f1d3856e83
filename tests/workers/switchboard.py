"""send_control for in-process workers: a queue and a delivering thread, as a deployer would
carry control messages (never one worker's loop calling another's). tests/workers/conftest.py
gives each test one as the `board` fixture."""

from __future__ import annotations

import queue
import threading
from typing import Any


class Switchboard:
    """send_control for in-process workers: a queue and a delivering thread."""

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, instance_id: str, message: Any) -> None:
        self._queue.put((instance_id, message))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                instance_id, message = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            worker = self.workers.get(instance_id)
            if worker is not None:  # messages to an instance that is not there are dropped
                worker.deliver(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for worker in self.workers.values():
            worker.shutdown()
