"""Reusable staging buffers for gathered (sent) and staged (received) KV messages.

A fresh multi-MB CPU tensor is page-faulted in on first touch, which costs more than the copy
into it (index_select into a new 4 MB tensor: ~1.5 ms; into a reused one: ~0.4 ms here). So
buffers go back to a pool once their send or receive has completed. A buffer whose operation
failed is never returned: the backend may still hold it.

On CUDA a received buffer goes back once its scatter into the cache is queued, not run: the next
operation into it is posted later on the same thread's stream (NCCL's stream waits for the
posting stream), so it cannot overwrite the buffer before the scatter has read it. The decode
side learns that the scatters ran from an event (rank_receiver.RecvHandle.done).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class StagingPool:
    """Buffers by (shape, dtype, device), at most `max_bytes` kept idle."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        key = (tuple(shape), dtype, device)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                buffer = idle.pop()
                self._idle_bytes -= buffer.nbytes
                return buffer
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        key = (tuple(buffer.shape), buffer.dtype, buffer.device)
        with self._lock:
            if self._idle_bytes + buffer.nbytes <= self.max_bytes:
                self._idle[key].append(buffer)
                self._idle_bytes += buffer.nbytes
