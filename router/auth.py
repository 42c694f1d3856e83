"""Bearer-token authentication: the one check, and its gRPC interceptor and WSGI wrapper.

A call without `authorization: Bearer <token>` matching the configured token is refused before
its handler runs. On gRPC that is UNAUTHENTICATED whatever the method: an unknown method is
refused too, so a caller without the token learns nothing about which methods exist. Only the
services the configuration names open (health, reflection: see RouterConfig) skip the check.
The scheme name is case-insensitive (RFC 7235: "bearer" is "Bearer"); the token is compared
exactly, in constant time. The HTTP API (router/http_api) and the metrics endpoint
(router/metrics_http.py) use the same check.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

import grpc

_MESSAGE = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"
_SCHEME = b"bearer"


def bearer_token_matches(authorization: str | bytes | None, expected: bytes) -> bool:
    """Whether an Authorization value is `Bearer <expected>`."""
    given = authorization or b""
    given = given if isinstance(given, bytes) else given.encode()
    scheme, _, token = given.partition(b" ")
    # Compare the token even when the scheme is wrong: the time taken says nothing.
    token_matches = hmac.compare_digest(token.strip(b" "), expected)
    return scheme.lower() == _SCHEME and token_matches


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, open_services: Collection[str] = ()) -> None:
        """`open_services`: full names of services whose methods need no token."""
        self._expected = token.encode()
        self._open_prefixes = tuple(f"/{service}/" for service in open_services)

    def _authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_token_matches(value, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if self._open_prefixes and method.startswith(self._open_prefixes):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler  # None for an unknown method: gRPC answers UNIMPLEMENTED
        return _denying_handler(handler)


def _denying_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers UNAUTHENTICATED. An unknown
    method (no handler) gets a streaming one: on the wire it serves a call of any shape."""

    async def deny(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    if handler is None:
        return grpc.stream_stream_rpc_method_handler(deny)
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def bearer_token_wsgi(app: WsgiApp, token: str) -> WsgiApp:
    """`app`, answering 401 to a request without `Authorization: Bearer <token>`."""
    expected = token.encode()

    def checked(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if bearer_token_matches(environ.get("HTTP_AUTHORIZATION"), expected):
            return app(environ, start_response)
        headers = [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")]
        start_response("401 Unauthorized", headers)
        return [b"missing or wrong bearer token: send the header 'Authorization: Bearer <token>'\n"]

    return checked
