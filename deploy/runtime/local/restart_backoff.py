"""When a dead worker may be restarted: a worker that cannot start (a bad model folder, a full
disk, a port taken) must not reload the model on every tick of the watch thread."""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class RestartBackoff:
    """When each instance may be restarted: at once the first time, then after a failed
    restart 1 s, doubling up to 30 s, until a restart succeeds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._delay_s: dict[str, float] = {}
        self._not_before: dict[str, float] = {}

    def due(self, instance_id: str) -> bool:
        return self._clock() >= self._not_before.get(instance_id, 0.0)

    def failed(self, instance_id: str) -> float:
        """Records a failed restart; returns the wait before the next one."""
        previous = self._delay_s.get(instance_id)
        delay_s = FIRST_BACKOFF_S if previous is None else min(2 * previous, MAX_BACKOFF_S)
        self._delay_s[instance_id] = delay_s
        self._not_before[instance_id] = self._clock() + delay_s
        return delay_s

    def succeeded(self, instance_id: str) -> None:
        self._delay_s.pop(instance_id, None)
        self._not_before.pop(instance_id, None)
