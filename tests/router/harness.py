"""A real router on 127.0.0.1, run on an asyncio loop in a background thread, for sync clients.

with RouterThread(config, make_handles) as server:   # make_handles() runs on the loop
    channel = grpc.insecure_channel(server.address)
    ...
    server.run(some_coroutine())                      # e.g. read a handle's load
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from router.config import RouterConfig
from router.server import Router

T = TypeVar("T")
_TIMEOUT_S = 30.0

HandleFactory = Callable[[], tuple[Sequence[Any], Sequence[Any]]]


class RouterThread:
    def __init__(self, config: RouterConfig, make_handles: HandleFactory) -> None:
        self._config = config
        self._make_handles = make_handles
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.router: Router | None = None
        self.prefill_handles: Sequence[Any] = ()
        self.decode_handles: Sequence[Any] = ()

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def run(self, coroutine: Awaitable[T], timeout_s: float = _TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)  # type: ignore[arg-type]

    async def _start(self) -> None:
        self.prefill_handles, self.decode_handles = self._make_handles()
        self.router = Router(self._config, self.prefill_handles, self.decode_handles)
        await self.router.start()

    async def _stop(self) -> None:
        if self.router is not None:
            await self.router.stop(grace_s=1.0)
        for handle in [*self.prefill_handles, *self.decode_handles]:
            close = getattr(handle, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result

    def loads(self) -> list[Any]:
        """Every handle's load report, prefill handles first."""
        handles = [*self.prefill_handles, *self.decode_handles]

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(h.load() for h in handles)))

        return self.run(gather())

    def __enter__(self) -> RouterThread:
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.run(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_TIMEOUT_S)
            self._loop.close()
