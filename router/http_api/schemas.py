"""The OpenAI API's request and response bodies, as pydantic models.

Requests take the fields OpenAI's SDK sends; a field pdserve cannot honour (logprobs, n > 1,
tools, penalties, ...) is refused with a 400 naming it (see `unsupported_field`), never silently
ignored. Fields the SDK does not know are ignored, as OpenAI does. A few vLLM extensions that
benchmark tools send are accepted: `top_k`, `ignore_eos`, `stop_token_ids`, `request_id` and
`stream_options.continuous_usage_stats` (usage on every chunk); and pdserve's own `ttft_slo_s`
and `tpot_slo_s`, the latency objectives an adaptive cluster places the request by.

Responses are built without validation (`model_construct`) on the streaming path: every chunk is
made here from values the router already checked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]
Count = Annotated[int, Field(le=_INT32_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class SamplingFields(_Request):
    """What both endpoints share."""

    model: str
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Count | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    request_id: str | None = None
    # pdserve extensions: the request's latency objectives, for an adaptive cluster's placement
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something pdserve does not do."""
        if self.n not in (None, 1):
            return "n", f"n={self.n}: only one choice per request is supported (n=1)"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, f"{name} is not supported; leave it unset or 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(SamplingFields):
    # A string, token ids, or a batch of one of either (a batch of more is refused).
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported; leave logprobs unset"
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported (only best_of=1)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported_field()


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported; leave logprobs unset or false"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().unsupported_field()


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM: the stop string that ended the text


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str
    stop_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
