"""`n` completions of one prompt: n sibling requests whose prompt KV is computed once.

The first sibling runs alone until its first token: by then the prompt's full KV blocks sit in
its prefill instance's prefix cache. The others start after that, so they take those blocks
from the cache (a KV-aware router sends them to the same instance) and compute only the
prompt's last, partial block. Their chunks interleave, each with its `index`.

Sibling i samples with seed + i when the request has a seed, so the n completions differ and the
request still reproduces. Only the first sibling computes prompt log-probabilities (they are the
same for all): the others leave them out, which also lets them use the prefix cache.
A failure of any sibling ends the whole request; closing the stream aborts every sibling.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from router.generation import GenerationChunk, GenerationRunner
from router.validation import ValidatedRequest

_Item = GenerationChunk | BaseException | None  # None: that sibling finished


def sibling(request: ValidatedRequest, index: int) -> ValidatedRequest:
    """The request of completion `index` of `request.n`."""
    params = request.params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + index)
    if index > 0:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-{index}", params=params, n=1
    )


async def generate_n(
    runner: GenerationRunner, request: ValidatedRequest, deadline_s: float | None = None
) -> AsyncIterator[GenerationChunk]:
    """Every chunk of the request's n completions, in arrival order, each with its index."""
    if request.n == 1:
        async with contextlib.aclosing(runner.generate(request, deadline_s)) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                yield chunk
        return
    queue: asyncio.Queue[tuple[int, _Item]] = asyncio.Queue()
    prompt_cached = asyncio.Event()

    async def run(index: int) -> None:
        if index > 0:
            await prompt_cached.wait()
        try:
            chunks = runner.generate(sibling(request, index), deadline_s)
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    prompt_cached.set()
                    queue.put_nowait(
                        (
                            index,
                            dataclasses.replace(chunk, request_id=request.request_id, index=index),
                        )
                    )
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            prompt_cached.set()

    tasks = [asyncio.create_task(run(index)) for index in range(request.n)]
    try:
        num_running = request.n
        while num_running:
            _, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
