"""OpenAI requests into the router's GenerateRequest, and the router's chunks into OpenAI bodies.

The HTTP front door takes the gRPC path from validation on: a request becomes the same
`GenerateRequest` a gRPC client would send, so one validator checks both and one runner serves
both. Sampling defaults are OpenAI's where they differ from pdserve's gRPC ones: an unset
`temperature` is 1 (gRPC: 0, greedy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve_proto.v1 import generation_pb2 as pb

from engine.outputs import TokenLogprob
from router.generation import GenerationChunk
from router.http_api.errors import bad_request
from router.http_api.logprobs import LogprobsWriter
from router.http_api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    Delta,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from router.http_api.structured import ConstraintConflict
from router.http_api.tools import ToolReply

OPENAI_DEFAULT_TEMPERATURE = 1.0


def _sampling(body: SamplingFields, request_id: str, max_tokens: int | None) -> pb.GenerateRequest:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    temperature = body.temperature
    return pb.GenerateRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        temperature=OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=stop,
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        ttft_slo_s=body.ttft_slo_s,
        tpot_slo_s=body.tpot_slo_s,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        prompt_logprobs=body.prompt_logprobs,
        n=body.n,
        logit_bias=_logit_bias(body.logit_bias),
        structured_output=_structured_output(body),
    )


def _structured_output(body: SamplingFields) -> pb.StructuredOutput | None:
    try:
        return body.structured_output()
    except ConstraintConflict as exc:
        raise bad_request(str(exc), exc.param) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    result = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) > 2**31 - 1:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
        result[int(key)] = value
    return result


def completion_to_proto(
    body: CompletionRequest, request_id: str, prompt: str | list[int]
) -> pb.GenerateRequest:
    request = _sampling(body, request_id, body.max_tokens)
    if body.logprobs is not None:
        request.logprobs = body.logprobs
        if body.echo and body.prompt_logprobs is None:
            request.prompt_logprobs = body.logprobs  # the echoed prompt's tokens are scored too
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty; send some text", "prompt")
        request.prompt = prompt
    else:
        if not prompt:
            raise bad_request("prompt is empty; send a list of token ids", "prompt")
        request.token_ids.extend(prompt)
    return request


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one, or each of a batch (a list of strings or of id lists)."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) == 0:
            raise bad_request("prompt is empty; send a string or a list of token ids", "prompt")
        if isinstance(prompt[0], (str, list)):
            return list(prompt)  # type: ignore[arg-type]
    return [prompt]  # type: ignore[list-item]


def chat_to_proto(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    if not body.messages:
        raise bad_request("messages is empty; send at least one message", "messages")
    max_tokens = body.max_completion_tokens
    request = _sampling(body, request_id, body.max_tokens if max_tokens is None else max_tokens)
    if body.logprobs:
        request.logprobs = body.top_logprobs or 0
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            for part_index, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{index}].content[{part_index}] is of type {part.type!r}; "
                        "only text parts are supported",
                        f"messages[{index}].content",
                    )
            content = "".join(part.text or "" for part in content)
        turn = request.messages.add(role=message.role, content=content or "")
        for call in message.tool_calls or ():
            turn.tool_calls.add(
                id=call.id, name=call.function.name, arguments=call.function.arguments
            )
        turn.tool_call_id = message.tool_call_id or ""
        turn.name = message.name or ""
    request.tools.extend(body.tool_protos())
    return request


def usage(
    num_prompt: int,
    num_completion: int,
    num_cached: int = 0,
    lasts: Sequence[GenerationChunk] = (),
) -> Usage:
    """With the choices' `lasts`: their speculative tokens accepted and rejected, summed."""
    details = None
    if lasts:
        accepted = sum(last.num_spec_accepted_tokens for last in lasts)
        proposed = sum(last.num_spec_proposed_tokens for last in lasts)
        details = CompletionTokensDetails.model_construct(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=proposed - accepted
        )
    return Usage.model_construct(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails.model_construct(cached_tokens=num_cached),
        completion_tokens_details=details,
    )


def final_usage(last: GenerationChunk) -> Usage:
    return usage(last.num_prompt_tokens, last.num_completion_tokens, last.num_cached_tokens, [last])


@dataclass
class _ChoiceState:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last: GenerationChunk | None = None
    started: bool = False  # its first event went out (the role, the echo)


@dataclass
class ResponseShape:
    """One request's response bodies: whole (`add` every chunk, then `complete`) or as
    server-sent events (`event`). `n` choices, told apart by their chunks' index. `writer` is
    set when the request asked for log-probabilities; `echo` (completions) puts the prompt's
    text, and with logprobs its tokens, before each choice's own."""

    chat: bool
    response_id: str
    model: str
    created: int
    num_prompt_tokens: int
    include_usage: bool = False
    continuous_usage: bool = False
    num_completion_tokens: int = 0
    n: int = 1
    writer: LogprobsWriter | None = None
    echo: bool = False
    prompt_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    wants_logprobs: bool = False  # the choices' logprobs
    wants_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the answer
    prompt_logprobs: list[TokenLogprob | None] | None = None
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    tools: ToolReply | None = None  # chat with tools: the answer's tool_calls
    index_offset: int = 0  # a batch's prompt i numbers its choices from i * n (http_api/batch.py)

    @property
    def num_finished(self) -> int:
        return sum(1 for c in self.choices.values() if c.last is not None)

    def add(self, chunk: GenerationChunk) -> _ChoiceState:
        state = self.choices.setdefault(chunk.index, _ChoiceState())
        state.texts.append(chunk.text)
        state.token_ids += chunk.token_ids
        state.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            state.last = chunk
        return state

    def total_usage(self) -> Usage:
        lasts = [c.last for c in self.choices.values() if c.last is not None]
        num_completion = sum(last.num_completion_tokens for last in lasts)
        num_cached = max((last.num_cached_tokens for last in lasts), default=0)
        return usage(self.num_prompt_tokens, num_completion, num_cached, lasts)

    def _vllm_prompt_logprobs(self) -> PromptLogprobs | None:
        if not self.wants_prompt_logprobs or self.writer is None or self.prompt_logprobs is None:
            return None
        return self.writer.prompt(self.prompt_logprobs)

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprob], echo: bool
    ) -> CompletionLogprobs | None:
        if self.writer is None or not self.wants_logprobs:
            return None
        entries: list[TokenLogprob | None] = list(logprobs)
        ids = list(token_ids)
        offset = 0
        if echo:
            prompt = self.prompt_logprobs or [None] * len(self.prompt_token_ids)
            entries, ids = [*prompt, *entries], [*self.prompt_token_ids, *ids]
        elif self.echo:
            offset = len(self.prompt_text)
        return self.writer.completion(entries, ids, offset)

    def complete(self) -> Completion | ChatCompletion:
        choices: list[Any] = []
        for index in sorted(self.choices):
            state = self.choices[index]
            last = state.last
            assert last is not None and last.finish_reason is not None
            text = "".join(state.texts)
            stop_reason = last.stop_reason or None
            if self.chat:
                chat_logprobs = None
                if self.writer is not None and self.wants_logprobs:
                    chat_logprobs = self.writer.chat(state.logprobs)
                content: str | None = text
                tool_calls, finish_reason = None, last.finish_reason
                if self.tools is not None:
                    content, tool_calls, finish_reason = self.tools.message(text, finish_reason)
                choices.append(
                    ChatChoice(
                        index=index,
                        message=AssistantMessage(content=content, tool_calls=tool_calls),
                        logprobs=chat_logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                )
            else:
                choices.append(
                    CompletionChoice.model_construct(
                        index=index + self.index_offset,
                        text=self.prompt_text + text if self.echo else text,
                        logprobs=self._completion_logprobs(
                            state.token_ids, state.logprobs, self.echo
                        ),
                        prompt_logprobs=self._vllm_prompt_logprobs(),
                        finish_reason=last.finish_reason,
                        stop_reason=stop_reason,
                    )
                )
        if self.chat:
            return ChatCompletion.model_construct(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=self.total_usage(),
                prompt_logprobs=self._vllm_prompt_logprobs(),
            )
        return Completion.model_construct(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.total_usage(),
        )

    def event(self, chunk: GenerationChunk) -> bytes | None:
        """The SSE event for a chunk; None for a chunk with nothing to say (text held back by
        the detokenizer), unless the client asked for usage on every chunk."""
        self.num_completion_tokens += len(chunk.token_ids)
        is_first = chunk.index not in self.choices or not self.choices[chunk.index].started
        state = self.add(chunk)
        finish_reason = chunk.finish_reason
        has_logprobs = self.wants_logprobs and bool(chunk.token_ids)
        echo_now = self.echo and is_first and not self.chat
        text: str | None = chunk.text
        tool_calls = None
        if self.tools is not None:
            text, tool_calls, finish_reason = self.tools.delta(
                chunk.index, chunk.text, finish_reason
            )
        if not (text or tool_calls or has_logprobs or echo_now) and finish_reason is None:
            if not self.continuous_usage:
                return None
        state.started = True  # an event goes out: the role, the echo go with it
        chunk_usage = None
        if self.continuous_usage:
            chunk_usage = usage(self.num_prompt_tokens, self.num_completion_tokens)
        stop_reason = chunk.stop_reason or None
        body: Completion | ChatCompletionChunk
        if self.chat:
            delta = Delta.model_construct(content=text, tool_calls=tool_calls)
            if is_first:  # OpenAI names the role in the first delta only
                delta.role = "assistant"
            chat_logprobs = None
            if self.writer is not None and self.wants_logprobs:
                chat_logprobs = self.writer.chat(chunk.logprobs or [])
            choice = ChatChunkChoice.model_construct(
                index=chunk.index,
                delta=delta,
                logprobs=chat_logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            body = ChatCompletionChunk.model_construct(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[choice],
                usage=chunk_usage,
            )
        else:
            text_choice = CompletionChoice.model_construct(
                index=chunk.index + self.index_offset,
                text=self.prompt_text + chunk.text if echo_now else chunk.text,
                logprobs=self._completion_logprobs(chunk.token_ids, chunk.logprobs or [], echo_now),
                prompt_logprobs=self._vllm_prompt_logprobs() if is_first else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            body = Completion.model_construct(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[text_choice],
                usage=chunk_usage,
            )
        return sse(body.model_dump_json())

    def usage_event(self, total: Usage | None = None) -> bytes:
        """stream_options.include_usage: a last chunk with no choices and the whole usage (this
        request's, or `total`: a batch's)."""
        body: Completion | ChatCompletionChunk
        kind = ChatCompletionChunk if self.chat else Completion
        body = kind.model_construct(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=total or self.total_usage(),
        )
        return sse(body.model_dump_json())


def sse(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
