"""Failures as OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}.

The status codes follow the gRPC ones the router already chose for each failure:
    INVALID_ARGUMENT -> 400      UNAUTHENTICATED -> 401     RESOURCE_EXHAUSTED -> 429
    UNAVAILABLE      -> 503      INTERNAL (a worker failed the request) -> 500
A 400 names the request field at fault in `param`.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from router.generation_errors import FailureKind, GenerationFailed
from router.http_api.schemas import ErrorBody, ErrorResponse

# status, OpenAI error type, code, and the label the router's failure counter uses for it
_BY_FAILURE = {
    FailureKind.OVERLOADED: (429, "rate_limit_error", "overloaded", "RESOURCE_EXHAUSTED"),
    FailureKind.UNAVAILABLE: (503, "service_unavailable_error", "unavailable", "UNAVAILABLE"),
    FailureKind.WORKER_ERROR: (500, "server_error", "worker_error", "INTERNAL"),
    FailureKind.DEADLINE: (504, "timeout_error", "deadline_exceeded", "DEADLINE_EXCEEDED"),
}
_FIELD_AT_START = re.compile(r"^([a-z_]+)((?:\[\d+\]|\.[a-z_]+)*)")
# Fields of the router's own request whose OpenAI name differs (the validator names its own).
_RENAMED = {"token_ids": "prompt"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        failure_label: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type_, param=param, code=code)
        self.failure_label = failure_label  # counted in pdserve:request_failure when set

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(
        400, message, param=param, code="invalid_value", failure_label="INVALID_ARGUMENT"
    )


def invalid_request(message: str, prompt_field: str, known: frozenset[str]) -> ApiError:
    """A 400 for a message from router.validation, with the field it is about.

    The validator's messages begin with the field's name where there is one ("top_p must be",
    "stop[1] is empty", "messages[0].role is"); the rest are about the prompt."""
    match = _FIELD_AT_START.match(message)
    param = prompt_field
    if match is not None and match.group(1) in known:
        param = _RENAMED.get(match.group(1), match.group(1)) + match.group(2)
        if param.startswith("prompt"):
            param = prompt_field + param[len("prompt") :]
    elif message.startswith("at most") and "stop strings" in message:
        param = "stop"
    return ApiError(
        400, message, param=param, code="invalid_value", failure_label="INVALID_ARGUMENT"
    )


def generation_failed(exc: GenerationFailed) -> ApiError:
    status, type_, code, label = _BY_FAILURE[exc.kind]
    return ApiError(status, str(exc), type_=type_, code=code, failure_label=label)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "missing or wrong bearer token: send the header 'Authorization: Bearer <token>'",
        type_="authentication_error",
        code="invalid_api_key",
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="service_unavailable_error", code="unavailable")


_MAX_ECHOED_CHARS = 80  # of a client's own text in a message: enough to recognise it


def model_not_found(model: str, served: str) -> ApiError:
    shown = repr(model[:_MAX_ECHOED_CHARS])
    if len(model) > _MAX_ECHOED_CHARS:
        shown += f"... ({len(model)} characters)"
    return ApiError(
        404,
        f"the model {shown} does not exist here; this server serves {served!r}",
        type_="not_found_error",
        param="model",
        code="model_not_found",
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is over the limit of {limit} bytes (router.http_max_body_bytes)",
        code="body_too_large",
        failure_label="INVALID_ARGUMENT",
    )
