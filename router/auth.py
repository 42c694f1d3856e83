"""Bearer-token authentication for every RPC, as a gRPC server interceptor.

A call without `authorization: Bearer <token>` metadata matching the configured token ends with
UNAUTHENTICATED before its handler runs. The comparison takes constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

_MESSAGE = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying_handler(handler)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers UNAUTHENTICATED."""

    async def deny(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

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
