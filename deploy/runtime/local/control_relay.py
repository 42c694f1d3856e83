"""Control messages between process-hosted workers (the no-Ray control plane).

A worker's `send_control(instance_id, message)` is a `PipeControl` (deploy/runtime/local/process_host.py): it
pickles the message and writes it up the worker's OWN pipe to this process, so a worker killed
mid-write (SIGKILL is a normal path: tests, a failed worker's os._exit) breaks only its own
pipe, never another worker's messages. The worker's ProcessWorker reads it there and hands it to
the relay, which delivers it with `deliver` on the addressed worker:

    worker A ──A's pipe──▶ ProcessWorker A's reader ──▶ ControlRelay.deliver("B", data)
                                                         └─▶ B's queue ─▶ B's delivery thread
                                                              ─▶ workers["B"].post(Deliver(msg))

One delivery thread per addressed instance posts what is queued for it as one batch and then waits
for the answers, so a peer busy in a long step takes them all between two steps, and a slow or
hung peer delays only the messages addressed to it. (Within a batch the peer may handle messages
in any order, as a threaded Ray actor may; each concerns one transfer.) Under Ray, actor calls do the same job
(deploy/runtime/ray/actors.py).
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from deploy.runtime.local.process_host import PipeControl, ProcessWorker
from worker.protocol import Deliver, WorkerUnavailable

logger = logging.getLogger(__name__)
_STOP = object()
_MAX_BATCH = 256  # messages posted to one peer before waiting for their answers


class ControlRelay:
    """Delivers control messages to the workers in `workers` (looked up at delivery, so workers
    may be added, or replaced by a restart, after the relay starts)."""

    def __init__(self, workers: Mapping[str, ProcessWorker], call_timeout_s: float = 10.0) -> None:
        self.workers = workers
        self.call_timeout_s = call_timeout_s
        self.num_forwarded = 0
        self.num_failed = 0  # messages that could not be read or delivered (logged)
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[object]] = {}
        self._threads: list[threading.Thread] = []
        self._stopped = False

    def sender(self) -> PipeControl:
        """A worker's `send_control`: pass it among the worker factory's arguments."""
        return PipeControl(self.deliver)

    def deliver(self, instance_id: str, data: bytes) -> None:
        """Queue a pickled message for `instance_id`; never blocks (a worker's pipe reader)."""
        with self._lock:
            if self._stopped:
                return
            inbox = self._queues.get(instance_id)
            if inbox is None:
                inbox = self._queues[instance_id] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._forward,
                    args=(instance_id, inbox),
                    daemon=True,
                    name=f"control-to-{instance_id}",
                )
                self._threads.append(thread)
                thread.start()
        inbox.put(data)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._stopped = True
            inboxes, threads = list(self._queues.values()), list(self._threads)
        for inbox in inboxes:
            inbox.put(_STOP)
        for thread in threads:
            thread.join(timeout_s)

    def _forward(self, instance_id: str, inbox: queue.SimpleQueue[object]) -> None:
        """One addressee's messages, in batches. Nothing a message does may end this thread:
        without it no ack or abort reaches the peer, and every hand-off to it would fail."""
        while True:
            batch = [inbox.get()]
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            messages = [data for data in batch if data is not _STOP]
            try:
                self._deliver_batch(instance_id, messages)  # type: ignore[arg-type]
            except Exception:
                self.num_failed += len(messages)
                logger.exception("control messages for %s could not be delivered", instance_id)
            if len(messages) < len(batch):
                return

    def _deliver_batch(self, instance_id: str, batch: list[bytes]) -> None:
        """Post every message of the batch, then wait for all: a peer busy in a long step takes
        them together between two steps, rather than one per step (acks then lagged the load
        by seconds, and the prefill side held the blocks they free)."""
        worker = self.workers.get(instance_id)
        if worker is None:
            return
        futures: list[Future[Any]] = []
        for data in batch:
            try:
                message = pickle.loads(data)  # noqa: S301 - from our own worker processes
                futures.append(worker.post(Deliver(message)))
            except WorkerUnavailable:
                return  # a dead or stopped instance: its peer's transfer deadline covers it
            except Exception:
                self.num_failed += 1
                logger.exception("a control message for %s could not be read", instance_id)
        deadline = time.monotonic() + self.call_timeout_s
        for future in futures:
            try:
                future.result(timeout=max(deadline - time.monotonic(), 0.0))
                self.num_forwarded += 1
            except (WorkerUnavailable, FutureTimeout):
                pass  # dead, or too slow: the peer's transfer deadline covers it
            except Exception:
                self.num_failed += 1
                logger.exception("a control message for %s failed in delivery", instance_id)
