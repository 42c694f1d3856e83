"""How the TP driver hands each step to ranks 1..n-1: one queue per rank in the TP group's store.

A rank between two steps waits for new work, and a wait for new work has no deadline. A gloo
collective always has one (the group's timeout), so a rank that waited for its next step inside
a broadcast died after that long with no traffic, taking the instance with it. Here a rank waits
in a blocking `queue_pop` on the store that the driver (rank 0) hosts instead:

    driver (rank 0)                       rank r
    post(message): pickle once,           take(): queue_pop("tp/steps/r"), no deadline;
      queue_push to every rank's queue      the store connection closes if the driver dies
    ... then the step's collectives ...   ... the same collectives (deadline: group timeout)

Liveness: the store lives in the driver's process, so a driver that dies closes the connection and
the blocked pop raises at once. `DriverWatch` also checks the store every `interval_s` on its own
connection, which notices a driver host that vanished without closing anything; the rank then
exits. A dead rank is noticed by the driver in the step's first collective (gloo sees the closed
connection, or the group's timeout passes) or before it, by the launcher.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
from typing import Any

import torch.distributed as dist

# queue_pop's wait goes to poll(2) in milliseconds (a C int): keep it well below 2**31 ms and
# wait again when it passes. This is not a deadline; it only bounds one system call.
_IDLE_WAIT = datetime.timedelta(days=7)
_QUEUE = "tp/steps/{rank}"


def _clone(store: dist.Store) -> dist.Store:
    """The same store over a connection of its own."""
    # Store.clone exists since torch 2.8, but torch's stub (_C/_distributed_c10d.pyi) omits it.
    return store.clone()  # type: ignore[attr-defined]


class StepQueue:
    """The driver's `post` and a rank's `take`, over a connection of its own to the TP store."""

    def __init__(self, store: dist.Store, tp_rank: int, tp_size: int) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._store = _clone(store)  # its own connection: a blocked pop holds it
        self._store.set_timeout(_IDLE_WAIT)
        self._key = _QUEUE.format(rank=tp_rank)

    def post(self, message: Any) -> None:
        """Driver only: queue `message` (picklable) for every other rank, in step order."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.tp_size):
            self._store.queue_push(_QUEUE.format(rank=rank), data)

    def take(self) -> Any:
        """Rank >= 1: the next message, however long it takes. Raises DistNetworkError (a
        RuntimeError) when the driver's store is gone."""
        while True:
            try:
                return pickle.loads(self._store.queue_pop(self._key))
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc):
                    raise
                # _IDLE_WAIT passed with the driver alive and quiet: keep waiting


class DriverWatch:
    """A rank's liveness check of its driver: the TP store must answer every `interval_s`
    (within `timeout_s`). When it does not, the rank exits: its driver is gone, and nothing it
    holds is of use to anyone."""

    def __init__(self, store: dist.Store, interval_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self._store = _clone(store)
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-driver-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.check([_QUEUE.format(rank=0)])
            except Exception as exc:  # the driver's process (or host) is gone
                if self._stop.is_set():
                    return  # a normal shutdown raced the check
                print(f"TP rank exits: its driver is gone ({exc})", file=sys.stderr, flush=True)
                os._exit(1)
