"""uvicorn serving the HTTP API on the router's own event loop, beside the gRPC server.

    http = HttpServer(app, "127.0.0.1", 0, grace_s=5.0)
    port = await http.start()       # bound (port 0: a free one) and accepting
    ...
    await http.stop(grace_s)        # stop accepting; in-flight responses get grace_s, then their
                                    # tasks are cancelled (which aborts their requests)

The socket is bound here, so a busy port fails `start()` with OSError (uvicorn would exit the
process). Requests are read with the header and body timeouts of router/http_api/read_timeouts.py.
uvicorn's signal handling is off: the process that owns the router decides when to
stop, and uvicorn's logging set-up is left alone (it would reconfigure the root logger).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from router.http_api.read_timeouts import timed_h11_protocol

# How long after `stop()`'s grace uvicorn may take to notice and close (it polls every 0.1 s).
_STOP_SLACK_S = 5.0


class _InLoopServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the router's owner handles SIGINT and SIGTERM

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        grace_s: float,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
    ) -> None:
        self._config = uvicorn.Config(
            app,
            http=timed_h11_protocol(header_timeout_s, body_timeout_s),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )
        self._host = host
        self._port = port
        self._server: _InLoopServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        sock.setblocking(False)
        server = _InLoopServer(self._config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait((task, ready), return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"the HTTP server on {self._host}:{self._port} stopped at start")
        self._server, self._task = server, task
        return int(sock.getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + _STOP_SLACK_S)
        except asyncio.TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = self._task = None
