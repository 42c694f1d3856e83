"""Reused daemon threads for the prefill side's per-transfer posters (send_handle.py)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable

import torch

from engine.rank_device import bind_thread

logger = logging.getLogger(__name__)


class Posters:
    """Daemon threads that run transfers' posters (SendHandle._poster), kept for the next one:
    starting a thread per transfer cost 0.1-0.5 ms on a busy core, in front of every transfer's
    first message. Each job gets a thread of its own (an idle one, or a new one when none is
    idle): a poster blocks until its transfer ends, so none may wait behind another."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None], device: torch.device | None = None) -> None:
        """Run `job` on a poster thread, whose current CUDA device is `device` for the job."""
        self._jobs.put(job if device is None else functools.partial(_on_device, device, job))
        with self._lock:
            if self._idle > 0:  # that thread is on its way to take a job from the queue
                self._idle -= 1
                return
        threading.Thread(target=self._work, name="kv-send", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a poster ends its own handle; nothing may end this thread
                logger.exception("a transfer's send thread failed")
            with self._lock:
                self._idle += 1


def _on_device(device: torch.device, job: Callable[[], None]) -> None:
    bind_thread(device)  # the threads are shared: each job binds its own rank's device
    job()


POSTERS = Posters()  # one per process
