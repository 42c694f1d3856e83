"""A completions request with a batch of prompts: each prompt is a request of its own (admitted,
placed and generated as any other), and their choices make one answer.

Choices are numbered as OpenAI numbers them: prompt i's completion j is choice i * n + j. Whole,
the answer lists them in that order with the usage of all summed; streamed, their events
interleave as they come, each with its number. A failure of any prompt ends the whole request,
and closing it aborts every prompt's generation (router/fanout.py's `interleave`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from router.fanout import generate_n, interleave
from router.generation import GenerationChunk, GenerationRunner
from router.http_api.schemas import Completion, Usage
from router.http_api.translate import ResponseShape
from router.validation import ValidatedRequest


def batch(
    runner: GenerationRunner, prepared: Sequence[tuple[ValidatedRequest, ResponseShape]]
) -> tuple[AsyncIterator[GenerationChunk], BatchShape]:
    """The chunks of every prompt (their index: the choice's number) and their shape."""
    n = prepared[0][0].n
    response_id = prepared[0][1].response_id.removesuffix("-p0")  # one id for the whole answer
    shapes = []
    for i, (_, shape) in enumerate(prepared):
        shape.index_offset = i * n
        shape.response_id = response_id
        shapes.append(shape)
    sources = [functools.partial(generate_n, runner, validated) for validated, _ in prepared]
    return _numbered(interleave(sources), n), BatchShape(shapes, n)


async def _numbered(
    chunks: AsyncIterator[tuple[int, GenerationChunk]], n: int
) -> AsyncIterator[GenerationChunk]:
    try:
        async for prompt_index, chunk in chunks:
            yield dataclasses.replace(chunk, index=prompt_index * n + chunk.index)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


class BatchShape:
    """ResponseShape's interface over one ResponseShape per prompt."""

    def __init__(self, shapes: list[ResponseShape], n: int) -> None:
        self._shapes = shapes
        self._n = n
        self.n = n * len(shapes)
        self.include_usage = shapes[0].include_usage

    def _route(self, chunk: GenerationChunk) -> tuple[ResponseShape, GenerationChunk]:
        shape = self._shapes[chunk.index // self._n]
        return shape, dataclasses.replace(chunk, index=chunk.index % self._n)

    @property
    def num_finished(self) -> int:
        return sum(shape.num_finished for shape in self._shapes)

    def add(self, chunk: GenerationChunk) -> Any:
        shape, own = self._route(chunk)
        return shape.add(own)

    def event(self, chunk: GenerationChunk) -> bytes | None:
        shape, own = self._route(chunk)
        return shape.event(own)

    def total_usage(self) -> Usage:
        usages = [shape.total_usage() for shape in self._shapes]
        prompt = sum(u.prompt_tokens for u in usages)
        completion = sum(u.completion_tokens for u in usages)
        body = usages[0].model_copy()
        body.prompt_tokens, body.completion_tokens = prompt, completion
        body.total_tokens = prompt + completion
        if body.prompt_tokens_details is not None:
            cached = sum(
                u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details
            )
            body.prompt_tokens_details = body.prompt_tokens_details.model_copy(
                update={"cached_tokens": cached}
            )
        return body

    def complete(self) -> Completion:
        bodies = [shape.complete() for shape in self._shapes]
        first = bodies[0]
        choices = [choice for body in bodies for choice in body.choices]
        return Completion.model_construct(
            id=first.id,
            created=first.created,
            model=first.model,
            choices=choices,
            usage=self.total_usage(),
        )

    def usage_event(self) -> bytes:
        return self._shapes[0].usage_event(self.total_usage())
