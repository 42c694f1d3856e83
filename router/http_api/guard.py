"""The HTTP API's door: a pure ASGI middleware that runs before routing and before the body.

    request -> token check (401, body unread) -> body read, bounded (413) -> the app

With a token configured, every path but the open ones (/health with `auth_exempt_health`,
/metrics on a loopback host) needs it, unknown paths included: an unauthenticated client learns
nothing of which routes exist, and no byte of its body is read or parsed. The body is then read
here, in full, up to `router.http_max_body_bytes`: a declared Content-Length over the limit is
refused before a byte is read, a chunked body as soon as it passes the limit. Either way the
router holds at most the limit per connection (uvicorn stops reading a connection whose app
does not take its body), never a whole oversized body. A refusal that leaves body bytes unread
closes the connection (`Connection: close`), so the rest of them is never read either. The app
then gets the body as one message; later `receive` calls (disconnect watchers) go through.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.auth import bearer_token_matches
from router.http_api import errors
from router.http_api.errors import ApiError


class FrontGuard:
    def __init__(
        self,
        app: ASGIApp,
        token: bytes | None,
        open_paths: Collection[str],
        max_body_bytes: int,
        count_failure: Callable[[str], None],
    ) -> None:
        self._app = app
        self._token = token
        self._open_paths = frozenset(open_paths)
        self._max_body_bytes = max_body_bytes
        self._count_failure = count_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self._token is not None and scope["path"] not in self._open_paths:
            authorization = _header(scope, b"authorization")
            if not bearer_token_matches(authorization, self._token):
                await self._refuse(errors.unauthorized(), scope, receive, send)
                return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit():
            if int(declared) > self._max_body_bytes:
                await self._refuse(
                    errors.body_too_large(self._max_body_bytes), scope, receive, send
                )
                return
        body = await self._read_body(receive)
        if body is None:  # the client went away mid-body: nobody to answer
            return
        if isinstance(body, ApiError):
            await self._refuse(body, scope, receive, send)
            return
        await self._app(scope, _Replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | ApiError | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self._max_body_bytes:
                return errors.body_too_large(self._max_body_bytes)
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        if error.failure_label is not None:
            self._count_failure(error.failure_label)
        response = error.response()
        response.headers["connection"] = "close"  # body bytes may be left unread
        await response(scope, receive, send)


class _Replay:
    """`receive` for the app: the body read already, then the connection's own messages."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
