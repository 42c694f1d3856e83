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
import functools
from collections.abc import AsyncIterator, Callable, Sequence

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
    siblings = [
        functools.partial(runner.generate, sibling(request, index), deadline_s)
        for index in range(request.n)
    ]
    merged = interleave(siblings, after_first=True)
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for index, chunk in merged:
            yield dataclasses.replace(chunk, request_id=request.request_id, index=index)


async def interleave(
    sources: Sequence[Callable[[], AsyncIterator[GenerationChunk]]], after_first: bool = False
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(source index, chunk) of every source's chunks, as they come. `after_first`: the others
    start once the first source's first chunk is out. A failure of any source ends them all
    (raised here); closing this generator closes every source."""
    queue: asyncio.Queue[tuple[int, _Item]] = asyncio.Queue()
    first_out = asyncio.Event()

    async def run(index: int) -> None:
        if index > 0 and after_first:
            await first_out.wait()
        try:
            async with contextlib.aclosing(sources[index]()) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    first_out.set()
                    queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            first_out.set()

    tasks = [asyncio.create_task(run(index)) for index in range(len(sources))]
    try:
        num_running = len(sources)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
