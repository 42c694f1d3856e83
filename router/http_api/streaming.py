"""Serving one generation over HTTP: whole or as server-sent events, ended by a disconnect too.

    stream:  first chunk (a failure here is a plain HTTP error: 429, 503, ...)
             -> 200 text/event-stream: one event per chunk, [usage], data: [DONE]
    whole:   every chunk -> one JSON body

A client that goes away ends the request at once, whatever it was waiting for: its task is
cancelled, which closes the runner's generator, whose `finally` aborts the request on every
worker that holds state for it (router/generation.py). While the first chunk is awaited (queue,
prefill) and for a whole response, a watcher on the connection's `receive` notices the
disconnect; while streaming, Starlette's own watcher does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.generation import GenerationChunk
from router.generation_errors import GenerationFailed
from router.http_api.batch import BatchShape
from router.http_api.errors import ApiError, generation_failed
from router.http_api.schemas import ErrorResponse
from router.http_api.translate import DONE, ResponseShape, sse
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping: `work` ends with this handler
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes its event generator however the response ends: a
    cancelled send leaves the generator suspended at a `yield`, holding the request open."""

    body_iterator: AsyncIterator[bytes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def stream_response(
    request: Request,
    chunks: AsyncIterator[GenerationChunk],
    shape: ResponseShape | BatchShape,
    metrics: RouterMetrics,
) -> Response:
    try:
        first = await until_disconnect(request, _first(chunks))
    except BaseException:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise
    return _EventStream(
        _events(first, chunks, shape, metrics),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _first(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    try:
        return await chunks.__anext__()
    except GenerationFailed as exc:
        raise generation_failed(exc) from exc


async def _events(
    first: GenerationChunk,
    chunks: AsyncIterator[GenerationChunk],
    shape: ResponseShape | BatchShape,
    metrics: RouterMetrics,
) -> AsyncIterator[bytes]:
    try:
        chunk = first
        while True:
            event = shape.event(chunk)
            if event is not None:
                yield event
            if shape.num_finished == shape.n:
                break
            chunk = await chunks.__anext__()
        if shape.include_usage:
            yield shape.usage_event()
    except GenerationFailed as exc:
        # Headers are out: the failure travels as an event, as OpenAI-compatible servers do.
        error = generation_failed(exc)
        if error.failure_label:
            metrics.request_failure.labels(error.failure_label).inc()
        yield sse(ErrorResponse(error=error.body).model_dump_json())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield DONE


async def whole_response(
    request: Request, chunks: AsyncIterator[GenerationChunk], shape: ResponseShape | BatchShape
) -> Response:
    async def collect() -> None:
        try:
            async for chunk in chunks:
                shape.add(chunk)
                if shape.num_finished == shape.n:
                    return
        except GenerationFailed as exc:
            raise generation_failed(exc) from exc
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        raise ApiError(500, "the generation ended without a finish reason", type_="server_error")

    await until_disconnect(request, collect())
    body = shape.complete()
    return Response(body.model_dump_json(), media_type="application/json")
