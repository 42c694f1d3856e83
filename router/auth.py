"""Bearer-token authentication for every RPC, as a gRPC server interceptor.

A call without `authorization: Bearer <token>` metadata matching the configured token ends with
UNAUTHENTICATED before its handler runs, whatever the method: an unknown method is refused too,
so a caller without the token learns nothing about which methods exist. The scheme name is
case-insensitive (RFC 7235: "bearer" is "Bearer"); the token is compared exactly, in constant
time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

_MESSAGE = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"
_SCHEME = "bearer"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def _authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else value.encode()
                scheme, _, token = given.partition(b" ")
                # Compare the token even when the scheme is wrong: the time taken says nothing.
                token_matches = hmac.compare_digest(token.strip(b" "), self._expected)
                return scheme.lower() == _SCHEME.encode() and token_matches
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
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
