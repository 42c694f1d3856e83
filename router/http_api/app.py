"""The OpenAI-compatible HTTP API as an ASGI app (FastAPI), over the router's generation path.

    GET  /v1/models             the one model this router serves
    POST /v1/completions        prompt as text or token ids
    POST /v1/chat/completions   messages through the model's chat template
    GET  /health                200 while the workers can take requests, 503 otherwise
    GET  /metrics               the router's Prometheus registry

A request becomes the gRPC API's GenerateRequest and goes through the same validator and the
same runner (admission, dispatch, streaming, cancellation, metrics) as a gRPC call does. When the
router has a token (the gRPC one), every path needs `Authorization: Bearer <token>`, except
/health with `auth_exempt_health` and /metrics on a loopback `http_host` (the rules of the gRPC
health service and of the metrics port; RouterConfig says why). The token and the body's size
are checked in front of the app, before routing and parsing (router/http_api/guard.py).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pdserve_proto.v1 import generation_pb2 as pb
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

from router.config import RouterConfig
from router.fanout import generate_n
from router.generation import GenerationRunner
from router.http_api import errors
from router.http_api.batch import BatchShape, batch
from router.http_api.errors import ApiError
from router.http_api.guard import FrontGuard
from router.http_api.logprobs import LogprobsWriter
from router.http_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from router.http_api.streaming import ClientGone, stream_response, whole_response
from router.http_api.structured import ConstraintConflict
from router.http_api.tool_parsers import parser_for_template
from router.http_api.tools import ToolReply
from router.http_api.translate import (
    ResponseShape,
    chat_to_proto,
    completion_prompts,
    completion_to_proto,
)
from router.metrics import RouterMetrics
from router.tokenizer import ModelLimits
from router.validation import InvalidRequest, RequestValidator, ValidatedRequest

# Request fields the validator's messages may begin with (see errors.invalid_request).
_VALIDATED_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "token_ids",
        "messages",
        "request_id",
        "prompt",
        "ttft_slo_s",
        "tpot_slo_s",
        "n",
        "logprobs",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logit_bias",
        "structured_output",
    }
)
_FIELD_NAME = re.compile(r"^[a-z_]{1,64}$")
_CLIENT_CLOSED = 499  # nginx's status for a request the client gave up on; nobody reads it


class OpenAIFrontDoor:
    """What the routes need from the router, and the steps they share."""

    def __init__(
        self,
        config: RouterConfig,
        limits: ModelLimits,
        validator: RequestValidator,
        runner: GenerationRunner,
        metrics: RouterMetrics,
        is_serving: Callable[[], bool],
    ) -> None:
        self.config = config
        self.limits = limits
        self.validator = validator
        self.runner = runner
        self.metrics = metrics
        self.is_serving = is_serving
        self.model_name = config.model_name
        self.created = int(time.time())
        template = getattr(validator.tokenizer.hf_tokenizer, "chat_template", None)
        self.tool_parser = parser_for_template(template if isinstance(template, str) else None)

    async def generate(
        self,
        http_request: Request,
        body: SamplingFields,
        grpc_requests: list[pb.GenerateRequest],
    ) -> Response:
        """One generation, or a batch of prompts (completions): one choice per prompt and n."""
        if body.model != self.model_name:
            raise errors.model_not_found(body.model, self.model_name)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise errors.bad_request(unsupported[1], unsupported[0])
        limit = self.config.max_prompts_per_request
        if len(grpc_requests) > limit:
            message = (
                f"prompt is a batch of {len(grpc_requests)}, over the limit of {limit} "
                "(router.max_prompts_per_request); split it"
            )
            raise errors.bad_request(message, "prompt")
        prepared = [await self._prepare(body, request) for request in grpc_requests]
        shape: ResponseShape | BatchShape
        if len(prepared) == 1:
            validated, shape = prepared[0]
            chunks = generate_n(self.runner, validated)
        else:
            chunks, shape = batch(self.runner, prepared)
        if body.stream:
            return await stream_response(http_request, chunks, shape, self.metrics)
        return await whole_response(http_request, chunks, shape)

    async def _prepare(
        self, body: SamplingFields, grpc_request: pb.GenerateRequest
    ) -> tuple[ValidatedRequest, ResponseShape]:
        chat = isinstance(body, ChatCompletionRequest)
        tools = self._tool_reply(body, grpc_request) if chat else None
        validated = await self._validate(grpc_request, body, chat)
        options = body.stream_options
        shape = ResponseShape(
            chat=chat,
            response_id=("chatcmpl-" if chat else "cmpl-") + validated.request_id,
            model=self.model_name,
            created=int(time.time()),
            num_prompt_tokens=len(validated.prompt_token_ids),
            include_usage=bool(body.stream and options and options.include_usage),
            continuous_usage=bool(body.stream and options and options.continuous_usage_stats),
            n=validated.n,
            prompt_token_ids=validated.prompt_token_ids,
            wants_prompt_logprobs=body.prompt_logprobs is not None,
            tools=tools,
        )
        params = validated.params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            shape.writer = LogprobsWriter(self.validator.tokenizer)
            shape.wants_logprobs = params.logprobs is not None
        if isinstance(body, CompletionRequest) and body.echo:
            shape.echo = True
            prompt = grpc_request.prompt
            shape.prompt_text = prompt or self.validator.tokenizer.decode(
                validated.prompt_token_ids
            )
        return validated, shape

    def _tool_reply(self, body: SamplingFields, request: pb.GenerateRequest) -> ToolReply | None:
        """The request's ToolMode as a reply shaper, its constraint set on `request`."""
        assert isinstance(body, ChatCompletionRequest)
        try:
            mode = body.tool_mode(self.tool_parser)
            if mode is None:
                return None
            constraint = body.tool_constraint(mode)
        except ConstraintConflict as exc:
            raise errors.bad_request(str(exc), exc.param) from None
        if constraint is not None:
            other = body.constraint_field()
            if other is not None:
                message = f"tool_choice and {other} both constrain the output: send one"
                raise errors.bad_request(message, other)
            request.structured_output.CopyFrom(constraint)
        return ToolReply(mode)

    async def _validate(
        self, request: pb.GenerateRequest, body: SamplingFields, chat: bool
    ) -> ValidatedRequest:
        try:
            return await self.validator.validate(request)
        except InvalidRequest as exc:
            error = errors.invalid_request(
                str(exc), "messages" if chat else "prompt", _VALIDATED_FIELDS
            )
            uses_new_name = isinstance(body, ChatCompletionRequest) and (
                body.max_completion_tokens is not None
            )
            if error.body.param == "max_tokens" and uses_new_name:
                error.body.param = "max_completion_tokens"
            if (error.body.param or "").startswith("structured_output"):
                error.body.param = body.constraint_field() or "tools"
            raise error from exc


def build_app(front: OpenAIFrontDoor) -> ASGIApp:
    """The routes, behind the token and body-size checks of FrontGuard."""
    config = front.config
    open_paths = set()
    if config.auth_exempt_health:
        open_paths.add("/health")
    if not config.http_metrics_need_auth:
        open_paths.add("/metrics")
    return FrontGuard(
        _routes(front),
        token=None if config.auth_token is None else config.auth_token.encode(),
        open_paths=open_paths,
        max_body_bytes=config.http_max_body_bytes,
        count_failure=lambda label: front.metrics.request_failure.labels(label).inc(),
    )


def _routes(front: OpenAIFrontDoor) -> FastAPI:
    app = FastAPI(
        title="pdserve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    _add_error_handlers(app, front.metrics)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=front.model_name, created=front.created, max_model_len=front.limits.max_model_len
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id = body.request_id or uuid.uuid4().hex
        prompts = completion_prompts(body)
        if len(prompts) == 1:
            return await front.generate(
                request, body, [completion_to_proto(body, request_id, prompts[0])]
            )
        # the prompts of a batch are requests of their own, named after the batch
        requests = [
            completion_to_proto(body, f"{request_id}-p{i}", prompt)
            for i, prompt in enumerate(prompts)
        ]
        return await front.generate(request, body, requests)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = body.request_id or uuid.uuid4().hex
        return await front.generate(request, body, [chat_to_proto(body, request_id)])

    @app.get("/health")
    async def health() -> Response:
        if not front.is_serving():
            raise errors.unavailable("no healthy worker can take requests (or the router stops)")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    async def api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.failure_label is not None:
            metrics.request_failure.labels(exc.failure_label).inc()
        return exc.response()

    async def invalid_body(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        metrics.request_failure.labels("INVALID_ARGUMENT").inc()
        return _body_error(exc.errors()).response()

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return ApiError(exc.status_code, str(exc.detail), code=None).response()

    async def client_gone(_request: Request, _exc: Exception) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)


def _body_error(problems: Any) -> ApiError:
    """A 400 for the first problem pydantic found, naming its field ("messages[0].content")."""
    if not problems:
        return errors.bad_request("the request body is not valid", None)
    # A value that fits no member of a union fails each: the value error (a lone surrogate, a
    # range) says more than "should be a valid string" from the member it never meant.
    problem = next((p for p in problems if p.get("type") == "value_error"), problems[0])
    location = [part for part in problem.get("loc", ()) if part != "body"]
    if problem.get("type") == "json_invalid":
        return errors.bad_request(f"the body is not valid JSON: {problem.get('msg')}", None)
    param = ""
    for part in location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _FIELD_NAME.match(str(part)) or part in ("str", "int", "float", "bool"):
            continue  # the union member pydantic tried, or a dict's key: not a field name
        elif not param:
            param = str(part)
        else:
            param += f".{part}"
    message = f"{param or 'body'}: {problem.get('msg', 'invalid value')}"
    return errors.bad_request(message, param or None)
