"""The pdserve.v1.Generation service: protobuf in, protobuf out, failures as gRPC statuses.

This is the one place that converts between protobuf and the router's own types. Requests are
parsed with `parse_generate_request` (not the stub's FromString), so invalid UTF-8 becomes
INVALID_ARGUMENT instead of an INTERNAL deserialization error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from pdserve_proto.v1 import generation_pb2 as pb

from engine.outputs import TokenLogprob
from router.fanout import generate_n
from router.generation import GenerationChunk, GenerationRunner
from router.generation_errors import FailureKind, GenerationFailed
from router.metrics import RouterMetrics
from router.timings import RouterTimings
from router.validation import InvalidRequest, RequestValidator, ValidatedRequest
from router.wire import MalformedRequest, parse_generate_request

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"

_STATUS_BY_FAILURE = {
    FailureKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureKind.WORKER_ERROR: grpc.StatusCode.INTERNAL,
    FailureKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


class GenerationServicer:
    def __init__(
        self, validator: RequestValidator, runner: GenerationRunner, metrics: RouterMetrics
    ) -> None:
        self._validator = validator
        self._runner = runner
        self._metrics = metrics

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate,
                    request_deserializer=parse_generate_request,
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
                "GenerateUnary": grpc.unary_unary_rpc_method_handler(
                    self.generate_unary,
                    request_deserializer=parse_generate_request,
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
            },
        )

    async def generate(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        validated = await self._validate(request, context)
        async with self._failures_as_status(context):
            chunks = self._generate(validated, context)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk_to_response(chunk, validated.prompt_token_ids)

    async def generate_unary(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        validated = await self._validate(request, context)
        if validated.n > 1:
            message = "n > 1 streams its completions apart: call Generate, not GenerateUnary"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs: list[pb.TokenLogprob] = []
        first: pb.GenerateResponse | None = None
        last: GenerationChunk | None = None
        async with self._failures_as_status(context):
            chunks = self._generate(validated, context)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    token_ids += chunk.token_ids
                    texts.append(chunk.text)
                    message = chunk_to_response(chunk, validated.prompt_token_ids)
                    logprobs += message.logprobs
                    first = first or message
                    last = chunk
        assert last is not None and last.finish_reason is not None and first is not None
        response = chunk_to_response(last)
        del response.token_ids[:]
        response.token_ids.extend(token_ids)
        response.text = "".join(texts)
        del response.logprobs[:]
        response.logprobs.extend(logprobs)
        # the last chunk is the first too when the whole completion came at once
        del response.prompt_logprobs[:]
        response.prompt_logprobs.extend(first.prompt_logprobs)
        response.prompt_token_ids.extend(first.prompt_token_ids)
        return response

    def _generate(
        self, request: ValidatedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[GenerationChunk, None]:
        chunks = generate_n(self._runner, request, context.time_remaining())
        # Closed at once (aclosing) when the client goes, which aborts the request on its
        # workers, instead of whenever the garbage collector finalizes the generator.
        assert isinstance(chunks, AsyncGenerator), "GenerationRunner.generate is an async generator"
        return chunks

    async def _validate(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> ValidatedRequest:
        try:
            if isinstance(request, MalformedRequest):
                raise InvalidRequest(request.message)
            return await self._validator.validate(request)
        except InvalidRequest as exc:
            self._metrics.request_failure.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable: abort raises") from exc

    @contextlib.asynccontextmanager
    async def _failures_as_status(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        try:
            yield
        except GenerationFailed as exc:
            code = _STATUS_BY_FAILURE[exc.kind]
            self._metrics.request_failure.labels(code.name).inc()
            await context.abort(code, str(exc))


def chunk_to_response(
    chunk: GenerationChunk, prompt_token_ids: list[int] | None = None
) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text, index=chunk.index
    )
    if chunk.logprobs is not None:
        response.logprobs.extend(_logprob_message(entry) for entry in chunk.logprobs)
    if chunk.prompt_logprobs is not None:
        response.prompt_logprobs.extend(_logprob_message(entry) for entry in chunk.prompt_logprobs)
        response.prompt_token_ids.extend(prompt_token_ids or ())
    if chunk.finish_reason is None:
        return response
    response.finish_reason = _FINISH_REASONS[chunk.finish_reason]
    response.stop_reason = chunk.stop_reason
    response.usage.prompt_tokens = chunk.num_prompt_tokens
    response.usage.completion_tokens = chunk.num_completion_tokens
    response.usage.cached_prompt_tokens = chunk.num_cached_tokens
    response.usage.spec_proposed_tokens = chunk.num_spec_proposed_tokens
    response.usage.spec_accepted_tokens = chunk.num_spec_accepted_tokens
    if chunk.timings is not None:
        _copy_timings(chunk.timings, response.timings)
        response.prefill_instance = chunk.prefill_instance
        response.decode_instance = chunk.decode_instance
    if chunk.placement is not None:
        placement = chunk.placement
        response.placement.kind = placement.kind
        response.placement.predicted_ttft_s = placement.predicted_ttft_s
        response.placement.predicted_tpot_s = placement.predicted_tpot_s
        response.placement.prefill_role_instances = placement.prefill_role_instances
    return response


def _logprob_message(entry: TokenLogprob | None) -> pb.TokenLogprob:
    """The first prompt token's entry (None: it has no context) is an empty message."""
    if entry is None:
        return pb.TokenLogprob()
    message = pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank)
    message.top.extend(pb.TopLogprob(token_id=t, logprob=v) for t, v in entry.top)
    return message


def _copy_timings(timings: RouterTimings, out: pb.Timings) -> None:
    out.router_queue_s = timings.router_queue_s
    out.prefill_queue_s = timings.prefill_queue_s
    out.prefill_s = timings.prefill_s
    out.kv_transfer_s = timings.kv_transfer_s
    out.decode_queue_s = timings.decode_queue_s
    out.decode_s = timings.decode_s
    out.first_token_s = timings.first_token_s
    out.per_token_s = timings.per_token_s
    out.e2e_s = timings.e2e_s
    out.retries = timings.retries
    out.migrations = timings.migrations
    out.recovery_s = timings.recovery_s
