"""The router in the serving process, on an event loop thread of its own (both runtimes).

    host = RouterHost(router_config)
    address = host.start(prefill_handles, decode_handles)   # gRPC (and HTTP, metrics) bound
    ...
    host.stop(grace_s=30)                                   # drain, abort the rest, close loop

Plain processes reach their workers through ProcessHandles, Ray through RayHandles; the router
itself runs here either way. It used to run in a Ray actor of its own in Ray mode, where it
shared an asyncio loop with Ray's actor-call machinery: under a burst of 1,500 streams that loop
accepted gRPC calls more slowly than it finished them, the excess waited inside gRPC core where
admission never sees a call, and a health probe timed out while health said SERVING. A process
of its own adds nothing to availability either: the Ray actors are owned by this process and go
down with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from engine.gc_tuning import freeze_startup_heap
from router.config import RouterConfig
from router.server import Router
from router.worker_api import DecodeHandle, PrefillHandle

_LOOP_TIMEOUT_S = 60.0
T = TypeVar("T")


class RouterHost:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.router: Router | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, prefill: Sequence[PrefillHandle], decode: Sequence[DecodeHandle]) -> str:
        """Start the loop thread and the router on it; returns the gRPC host:port."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="router-loop", daemon=True
        )
        self._thread.start()
        self.router = Router(self.config, list(prefill), list(decode))
        self.run(self.router.start())
        freeze_startup_heap()  # the model and the router are built: keep them out of GC scans
        return self.router.address

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = _LOOP_TIMEOUT_S) -> T:
        """Run `coroutine` on the router's loop and wait for its result."""
        assert self._loop is not None, "start() the router first"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop admitting, let in-flight streams finish for `grace_s` (default: the config's
        `shutdown_grace_s`), abort the rest, and close the loop; idempotent."""
        if self._loop is None:
            return
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        try:
            if self.router is not None:
                self.run(self.router.stop(grace), timeout_s=_LOOP_TIMEOUT_S + grace)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(_LOOP_TIMEOUT_S)
            self._loop.close()
            self._loop = None

    @property
    def address(self) -> str:
        assert self.router is not None, "start() the router first"
        return self.router.address

    @property
    def metrics_port(self) -> int | None:
        return None if self.router is None else self.router.metrics_port

    @property
    def http_port(self) -> int | None:
        return None if self.router is None else self.router.http_port
