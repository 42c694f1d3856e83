"""One shard of the load against any OpenAI-compatible server (vLLM, SGLang, pdserve's HTTP API).

The same requests as the gRPC client (client.py): `POST /v1/completions` with the prompt as token
ids, `max_tokens` = the target, `ignore_eos` (vLLM's and SGLang's extension, which pdserve takes
too), the request's class SLOs (`ttft_slo_s`, `tpot_slo_s`: pdserve's extension, by which an
adaptive cluster places it; other servers ignore fields they do not know), greedy, streamed as
server-sent events with usage (STREAM_OPTIONS). Sent through the
official `openai` SDK, so what it measures is what an ordinary client sees.

Token times: with per-chunk usage (STREAM_OPTIONS) every chunk's new completion tokens arrive at
its time, exactly. A server without it sends text chunks only: each is one arrival, and since it
may pack several tokens in one chunk (or send none for a token that ends mid-character) the
record is fitted to the final usage's token count: the first and last arrival stay, the ones
between are repeated or dropped, so TPOT ((last - first) / (tokens - 1), DistServe's definition)
comes out right; TTFT is then the first visible text.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from benchmarks.goodput.workloads import BenchRequest
from planner.metrics import RequestRecord

API_KEY_ENV = "OPENAI_API_KEY"  # sent as the bearer token when set (pdserve's auth_token)
# continuous_usage_stats (vLLM's, SGLang's and pdserve's): a chunk for every step, with the
# completion tokens so far, even when the detokenizer holds the step's text back (a token that
# ends mid-character). Without it the first token of such a request shows up only with the
# next text, one or more steps late.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def fit_arrivals(times: list[float], num_tokens: int) -> list[float]:
    """`num_tokens` times with the same first and last as `times` (see the module docstring)."""
    if not times or num_tokens <= 0:
        return []
    if num_tokens == 1:
        return times[:1]
    if len(times) == 1:
        return times * num_tokens
    middle = times[1:-1]
    wanted = num_tokens - 2
    if len(middle) >= wanted:
        middle = middle[:wanted]
    else:
        middle = middle + [times[-1]] * (wanted - len(middle))
    return [times[0], *middle, times[-1]]


async def _one_request(
    client: Any, model: str, request: BenchRequest, clock: Any, shard: int
) -> RequestRecord:
    import openai

    record = RequestRecord(
        request.request_id,
        len(request.prompt_token_ids),
        request.output_len,
        clock.now(),
        shard=shard,
    )
    arrivals: list[float] = []  # one per token with per-chunk usage, else one per text chunk
    counted = 0  # completion tokens the per-chunk usage has reported so far
    num_tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(request.prompt_token_ids),
            max_tokens=request.output_len,
            temperature=0.0,
            stream=True,
            stream_options=STREAM_OPTIONS,
            extra_body=_extra_body(request),
        )
        async for chunk in stream:
            now = clock.now()
            usage = chunk.usage
            for choice in chunk.choices:
                if usage is not None:  # exact: every step's chunk, text or not, with its count
                    arrivals.extend([now] * (usage.completion_tokens - counted))
                    counted = usage.completion_tokens
                elif choice.text:
                    arrivals.append(now)
                if choice.finish_reason:
                    record.finish_reason = choice.finish_reason
            if usage is not None:
                num_tokens = usage.completion_tokens
    except openai.APIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if not record.error and not record.finish_reason:
        record.error = "the stream ended without a finish_reason"
    record.token_times = fit_arrivals(arrivals, num_tokens or len(arrivals))
    return record


async def served_model(client: Any) -> str:
    """The first model the server lists (vLLM and SGLang insist on their served name)."""
    models = await client.models.list()
    for model in models.data:
        return str(model.id)
    raise RuntimeError("the server lists no model at /v1/models")


async def run_http_shard_async(
    base_url: str,
    requests: list[BenchRequest],
    start_wall_time: float,
    shard: int,
    request_timeout_s: float,
    clock: Any,
) -> list[RequestRecord]:
    """Send each request at start_wall_time + its offset; every record, in request order."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=os.environ.get(API_KEY_ENV) or "none",
        timeout=request_timeout_s,
        max_retries=0,
    )
    async with client:
        model = await served_model(client)
        tasks = []
        for request in sorted(requests, key=lambda r: r.send_offset_s):
            delay = start_wall_time + request.send_offset_s - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one_request(client, model, request, clock, shard)))
        records = await asyncio.gather(*tasks)
    by_id = {record.request_id: record for record in records}
    return [by_id[request.request_id] for request in requests]


def _extra_body(request: BenchRequest) -> dict[str, object]:
    """The non-OpenAI fields: ignore_eos, and the SLOs when the request has them."""
    extra: dict[str, object] = {"ignore_eos": True}
    for name in ("ttft_slo_s", "tpot_slo_s"):
        value = getattr(request, name)
        if value is not None:
            extra[name] = value
    return extra
