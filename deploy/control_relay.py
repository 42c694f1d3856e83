"""Control messages between process-hosted workers (the no-Ray control plane).

A worker's `send_control(instance_id, message)` is a `QueueControl`: it puts the pair on one
queue shared by the cluster, and returns at once (a worker's loop thread must never block on
another worker). The relay's thread takes each pair off the queue and calls `deliver` on the
addressed worker. Under Ray, actor calls do the same job (deploy/ray_actors.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

import torch.multiprocessing as mp

from deploy.process_host import ProcessWorker
from engine.messages import WorkerUnavailable


class QueueControl:
    """A worker's `send_control`: (instance_id, message) onto the cluster's control queue.
    Picklable, so it travels to the worker process with the factory's arguments."""

    def __init__(self, control_queue: Any) -> None:
        self.queue = control_queue

    def __call__(self, instance_id: str, message: Any) -> None:
        self.queue.put((instance_id, message))


class ControlRelay:
    """Delivers queued control messages to the workers in `workers` (looked up at delivery, so
    workers may be added after the relay starts)."""

    def __init__(self, workers: Mapping[str, ProcessWorker], call_timeout_s: float = 10.0) -> None:
        self.workers = workers
        self.call_timeout_s = call_timeout_s
        self.num_forwarded = 0
        self._queue = mp.get_context("spawn").Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="control-relay", daemon=True)
        self._thread.start()

    def sender(self) -> QueueControl:
        return QueueControl(self._queue)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._queue.close()
        self._queue.join_thread()

    def _forward(self) -> None:
        while not self._stop.is_set():
            try:
                instance_id, message = self._queue.get(timeout=0.05)
            except (queue.Empty, OSError, EOFError):
                continue
            worker = self.workers.get(instance_id)
            if worker is None:
                continue
            try:
                worker.call("deliver", message, timeout_s=self.call_timeout_s)
                self.num_forwarded += 1
            except WorkerUnavailable:
                pass  # a dead or stopped instance: its peer's transfer deadline covers it
