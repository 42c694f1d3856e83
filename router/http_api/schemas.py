"""The OpenAI API's request and response bodies, as pydantic models.

Requests take the fields OpenAI's SDK sends; a field pdserve cannot honour (best_of, suffix)
is refused with a 400 naming it (see
`unsupported_field`), never silently ignored. Fields the SDK does not know are ignored, as OpenAI
does. A few vLLM extensions are accepted: `top_k`, `ignore_eos`, `stop_token_ids`, `request_id`,
`repetition_penalty`, `min_tokens`, `prompt_logprobs`, `stream_options.continuous_usage_stats`
(usage on every chunk) and the structured-output fields (http_api/structured.py); and pdserve's own `ttft_slo_s` and `tpot_slo_s`, the latency objectives
an adaptive cluster places the request by.

Types are strict, as JSON's are: `"stream": "yes"` or `"max_tokens": true` is a 400 naming the
field, not a guess. Every string is checked for lone surrogates (`"\\ud800"` is valid JSON but no
UTF-8 text), every integer against the range of the router's message field it fills, so nothing
the schema accepts can fail later where the request becomes a protobuf message.

Responses are built without validation (`model_construct`) on the streaming path: every chunk is
made here from values the router already checked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    field_validator,
)

from router.http_api.structured import StructuredFields
from router.http_api.tools import ToolCallIn, ToolFields

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def _utf8_text(value: str) -> str:
    """Refuse a lone surrogate: JSON can spell one, UTF-8 (and so protobuf) cannot hold it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate (character {exc.start}) that is no valid Unicode text; "
            "send text that encodes as UTF-8"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_utf8_text)]
TokenId = Annotated[StrictInt, Field(ge=0, le=_INT32[1])]
Count = Annotated[StrictInt, Field(ge=_INT32[0], le=_INT32[1])]  # an int32 field of the proto
Seed = Annotated[StrictInt, Field(ge=_INT64[0], le=_INT64[1])]
Number = StrictFloat  # takes an integer too ("temperature": 0), never a string or a bool

# Validating a JSON array costs per item, before any check of the request's size could refuse
# it: within `http_max_body_bytes`, 262,000 messages took seconds of the event loop. So arrays
# that grow with a prompt are counted (cheaply, on the raw value) before their items are
# validated. A conversation of more messages than this is no chat (OpenAI caps it at 2,048).
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096  # text parts of all messages together
MAX_STOP_TOKEN_IDS = 1024
MAX_BATCH_PROMPTS = 4096  # prompts of one completions batch (router.max_prompts_per_request <=)


def _prompt_shape(value: Any) -> str:
    """The one union member a prompt's raw value is meant as, from its shape alone.

    Trying every member (pydantic's default) validates a 2,000,000-id prompt four times and
    builds an error for each id under `list[str]`; this picks one. The tags are the members'
    type names, which the error handler leaves out of the field's name (`prompt[3]`)."""
    if not isinstance(value, list):
        return "str"
    if value and isinstance(value[0], str):
        return "list[str]"
    if value and isinstance(value[0], list):
        return "list[list[int]]"
    return "list[int]"


Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Tag("list[str]")]
    | Annotated[list[TokenId], Tag("list[int]")]
    | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


def _at_most(value: Any, limit: int, what: str) -> None:
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"has {len(value)} {what}, over the limit of {limit}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM: usage on every chunk


class SamplingFields(StructuredFields):
    """What both endpoints share."""

    model: Text
    max_tokens: Count | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    n: Count | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[Text, Number] | None = None
    user: Text | None = None
    # vLLM extensions
    top_k: Count | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    request_id: Text | None = None
    repetition_penalty: Number | None = None
    min_tokens: Count | None = None
    prompt_logprobs: Count | None = None
    # pdserve extensions: the request's latency objectives, for an adaptive cluster's placement
    ttft_slo_s: Number | None = None
    tpot_slo_s: Number | None = None

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _few_stop_token_ids(cls, value: Any) -> Any:
        _at_most(value, MAX_STOP_TOKEN_IDS, "ids")
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something pdserve does not do."""
        return None


class CompletionRequest(SamplingFields):
    # A string, token ids, or a batch of either (http_api/batch.py): a choice per prompt and n.
    prompt: Prompt
    logprobs: Count | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        """A huge batch is refused before its prompts are validated (each would be)."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > MAX_BATCH_PROMPTS:
                raise ValueError(
                    f"is a batch of {len(value)} prompts, over the limit of {MAX_BATCH_PROMPTS}"
                )
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported (only best_of=1)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported_field()


class TextPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Text
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    name: Text | None = None


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Count | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        _at_most(value, MAX_MESSAGES, "messages")
        if isinstance(value, list):
            num_parts = sum(
                len(content)
                for message in value
                if isinstance(message, dict) and isinstance(content := message.get("content"), list)
            )
            if num_parts > MAX_CONTENT_PARTS:
                raise ValueError(
                    f"has {num_parts} content parts, over the limit of {MAX_CONTENT_PARTS}"
                )
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported_field()


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's prediction counts, here speculative decoding's: of the tokens proposed for the
    request, those the model accepted and those it rejected (0 and 0 without speculation)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token (prompt first, with echo) its text, logprob, the
    most likely tokens by text, and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, one per token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM: the stop string that ended the text


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: Text
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # http_api/tools.py


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: Text
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: Text
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
