"""Check a GenerateRequest and turn it into token ids and sampling parameters.

Every rejection is an `InvalidRequest` whose message says what to fix; the servicer answers it
with INVALID_ARGUMENT. Nothing here touches a worker.

A prompt's size is checked before it is tokenized (a bound of `max_prompt_chars_per_token`
characters per token of the model's maximum length), so an oversized prompt costs nothing. A
long prompt is tokenized on a thread of its own (the tokenizer releases the GIL), so the event
loop keeps streaming every other request's tokens meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve_proto.v1 import generation_pb2 as pb

from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from router.adaptive import RequestSLO
from router.chat import InvalidChat, chat_inputs
from router.config import RouterConfig
from router.structured import GrammarCheck, InvalidStructuredOutput, spec_from_request
from router.tokenizer import ChatTemplateError, ModelLimits, RouterTokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128
MAX_TEMPERATURE = 100.0
# A smaller top_p is 0 in float32 or close to it: it means greedy, so ask for that instead.
MIN_TOP_P = 1e-6
# Shorter prompts are tokenized on the event loop: a hop to a thread costs more than they do.
MAX_INLINE_TOKENIZE_CHARS = 8192
_TEMPLATE_CHARS_PER_MESSAGE = 32  # about what a chat template adds around each message
_TOKENIZER_THREADS = 2
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_N = 16  # completions per request


_T = TypeVar("_T")


class InvalidRequest(ValueError):
    """A request the router refuses; the message tells the client what to change."""


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    slo: RequestSLO | None = None  # the request's own latency objectives, when it set them
    n: int = 1  # completions to generate for the prompt (router/fanout.py)


class RequestValidator:
    def __init__(
        self, config: RouterConfig, tokenizer: RouterTokenizer, limits: ModelLimits
    ) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._limits = limits
        self._max_prompt_chars = limits.max_model_len * config.max_prompt_chars_per_token
        self._executor = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._grammars = GrammarCheck(config, tokenizer, limits.vocab_size)

    @property
    def tokenizer(self) -> RouterTokenizer:
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._grammars.close()

    async def validate(self, request: pb.GenerateRequest) -> ValidatedRequest:
        request_id = self._request_id(request.request_id)
        params = self._sampling_params(request)
        try:
            structured = spec_from_request(request)
            if structured is not None:
                field = f"structured_output.{request.structured_output.WhichOneof('constraint')}"
                await self._grammars.check(structured, field)
                params = dataclasses.replace(params, structured=structured)
        except InvalidStructuredOutput as exc:
            raise InvalidRequest(str(exc)) from None
        stop_strings = self._stop_strings(request.stop)
        prompt_token_ids = await self._prompt_token_ids(request)
        num_total = len(prompt_token_ids) + params.max_tokens
        if num_total > self._limits.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens and max_tokens is "
                f"{params.max_tokens}: together {num_total}, over the model's maximum length "
                f"{self._limits.max_model_len}; shorten the prompt or lower max_tokens"
            )
        slo = self._slo(request)
        n = request.n if request.HasField("n") else 1
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
        return ValidatedRequest(request_id, prompt_token_ids, params, stop_strings, slo, n)

    def _slo(self, request: pb.GenerateRequest) -> RequestSLO | None:
        """The request's TTFT and TPOT objectives (an unset one takes the router's default)."""
        has_ttft, has_tpot = request.HasField("ttft_slo_s"), request.HasField("tpot_slo_s")
        if not (has_ttft or has_tpot):
            return None
        for name, present in (("ttft_slo_s", has_ttft), ("tpot_slo_s", has_tpot)):
            value = getattr(request, name)
            if present and not (math.isfinite(value) and value > 0):
                raise InvalidRequest(
                    f"{name} must be a number of seconds > 0, got {value!r}; leave it unset "
                    "for the router's default"
                )
        config = self._config
        return RequestSLO(
            request.ttft_slo_s if has_ttft else config.default_ttft_slo_s,
            request.tpot_slo_s if has_tpot else config.default_tpot_slo_s,
        )

    def _request_id(self, request_id: str) -> str:
        if not request_id:
            return uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            raise InvalidRequest(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters "
                "(or empty, to let the router name the request)"
            )
        return request_id

    async def _prompt_token_ids(self, request: pb.GenerateRequest) -> list[int]:
        given = [
            name
            for name, present in (
                ("prompt", bool(request.prompt)),
                ("token_ids", len(request.token_ids) > 0),
                ("messages", len(request.messages) > 0),
            )
            if present
        ]
        if not given:
            raise InvalidRequest("the prompt is empty: set one of prompt, token_ids or messages")
        if len(given) > 1:
            raise InvalidRequest(f"set only one of prompt, token_ids or messages, not {given}")
        if request.prompt:
            prompt = request.prompt
            self._check_prompt_chars("the prompt has", len(prompt))
            return await self._tokenize(self._tokenizer.encode, prompt, len(prompt))
        if request.token_ids:
            if len(request.token_ids) > self._limits.max_model_len:
                raise InvalidRequest(
                    f"token_ids has {len(request.token_ids)} ids, over the model's maximum "
                    f"length {self._limits.max_model_len}; shorten the prompt"
                )
            return self._check_token_ids("token_ids", list(request.token_ids))
        return await self._chat_token_ids(request.messages, request.tools)

    def _check_prompt_chars(self, what: str, num_chars: int) -> None:
        if num_chars > self._max_prompt_chars:
            raise InvalidRequest(
                f"{what} {num_chars} characters, over the limit of {self._max_prompt_chars} "
                f"({self._config.max_prompt_chars_per_token} per token of the model's maximum "
                f"length {self._limits.max_model_len}); shorten the prompt"
            )

    async def _tokenize(self, encode: Callable[[_T], list[int]], text: _T, size: int) -> list[int]:
        if size <= MAX_INLINE_TOKENIZE_CHARS:
            return encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._executor, encode, text)

    async def _chat_token_ids(
        self, messages: Sequence[pb.ChatMessage], tools: Sequence[pb.Tool]
    ) -> list[int]:
        for index, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"messages[{index}].role is {message.role!r}; use one of {CHAT_ROLES}"
                )
        max_model_len = self._limits.max_model_len
        if len(messages) > max_model_len:  # every template spends a token or more on each
            raise InvalidRequest(
                f"there are {len(messages)} messages, more than the model's maximum length "
                f"{max_model_len} could hold; send fewer"
            )
        num_chars = sum(
            len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages
        ) + sum(len(t.parameters) + len(t.description) for t in tools)
        self._check_prompt_chars("the messages have", num_chars)
        if tools and not messages:
            raise InvalidRequest("tools need messages: a chat template renders them")
        try:
            inputs = chat_inputs(messages, tools)
        except InvalidChat as exc:
            raise InvalidRequest(str(exc)) from None
        # The template writes each message's role and markers too: many short messages are
        # rendered off the event loop like one long one.
        size = num_chars + len(messages) * _TEMPLATE_CHARS_PER_MESSAGE
        try:
            token_ids = await self._tokenize(
                lambda both: self._tokenizer.encode_chat(*both), inputs, size
            )
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc)) from exc
        if not token_ids:
            raise InvalidRequest("the messages render to an empty prompt; add some content")
        return token_ids

    def _check_token_ids(self, field_name: str, token_ids: list[int]) -> list[int]:
        vocab_size = self._limits.vocab_size
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(
                    f"{field_name}[{position}] = {token_id} is outside the vocabulary: "
                    f"token ids must be in [0, {vocab_size})"
                )
        return token_ids

    def _sampling_params(self, request: pb.GenerateRequest) -> SamplingParams:
        max_tokens = (
            request.max_tokens
            if request.HasField("max_tokens")
            else self._config.default_max_tokens
        )
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        temperature = request.temperature if request.HasField("temperature") else 0.0
        if not 0.0 <= temperature <= MAX_TEMPERATURE:  # also false for NaN
            raise InvalidRequest(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {temperature}"
            )
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_p = request.top_p if request.HasField("top_p") else 1.0
        if not MIN_TOP_P <= top_p <= 1.0:  # also false for NaN
            raise InvalidRequest(
                f"top_p must be in [{MIN_TOP_P:g}, 1] (1 disables it; for greedy set "
                f"temperature 0), got {top_p}"
            )
        top_k = request.top_k if request.HasField("top_k") else 0
        if top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {top_k}")
        seed = request.seed if request.HasField("seed") else None
        if seed is not None and seed < 0:
            raise InvalidRequest(f"seed must be >= 0, got {seed}")
        stop_token_ids = self._check_token_ids("stop_token_ids", list(request.stop_token_ids))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=request.ignore_eos,
            **self._output_fields(request, max_tokens),
        )

    def _output_fields(self, request: pb.GenerateRequest, max_tokens: int) -> dict[str, Any]:
        """Log-probabilities and logits processors, checked with messages naming the field."""
        fields: dict[str, Any] = {}
        for name in ("logprobs", "prompt_logprobs"):
            if request.HasField(name):
                value = getattr(request, name)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
                fields[name] = value
        for name, low, high in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("repetition_penalty", 0.0, 100.0),
        ):
            if request.HasField(name):
                value = getattr(request, name)
                inside = low < value <= high if low == 0.0 else low <= value <= high
                if not inside:  # also false for NaN
                    raise InvalidRequest(f"{name} must be in [{low:g}, {high:g}], got {value}")
                fields[name] = value
        if request.HasField("min_tokens"):
            if not 0 <= request.min_tokens <= max_tokens:
                raise InvalidRequest(
                    f"min_tokens must be in [0, max_tokens={max_tokens}], got {request.min_tokens}"
                )
            fields["min_tokens"] = request.min_tokens
        if request.logit_bias:
            bias = dict(request.logit_bias)
            self._check_token_ids("logit_bias", sorted(bias))
            for token_id, value in bias.items():
                if not -100.0 <= value <= 100.0:
                    raise InvalidRequest(
                        f"logit_bias[{token_id}] must be in [-100, 100], got {value}"
                    )
            fields["logit_bias"] = bias
        return fields

    def _stop_strings(self, stop: list[str]) -> tuple[str, ...]:
        if len(stop) > self._config.max_stop_strings:
            raise InvalidRequest(
                f"at most {self._config.max_stop_strings} stop strings are allowed, got {len(stop)}"
            )
        for index, stop_string in enumerate(stop):
            if not stop_string:
                raise InvalidRequest(f"stop[{index}] is empty; remove it")
        return tuple(stop)
