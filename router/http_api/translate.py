"""OpenAI requests into the router's GenerateRequest, and the router's chunks into OpenAI bodies.

The HTTP front door takes the gRPC path from validation on: a request becomes the same
`GenerateRequest` a gRPC client would send, so one validator checks both and one runner serves
both. Sampling defaults are OpenAI's where they differ from pdserve's gRPC ones: an unset
`temperature` is 1 (gRPC: 0, greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve_proto.v1 import generation_pb2 as pb

from router.generation import GenerationChunk
from router.http_api.errors import bad_request
from router.http_api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)

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
    )


def completion_to_proto(body: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    request = _sampling(body, request_id, body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) == 0:
            raise bad_request("prompt is empty; send a string or a list of token ids", "prompt")
        if isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise bad_request(
                    f"prompt is a batch of {len(prompt)}; send one prompt per request", "prompt"
                )
            prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty; send some text", "prompt")
        request.prompt = prompt
    else:
        if not prompt:
            raise bad_request("prompt is empty; send a list of token ids", "prompt")
        request.token_ids.extend(prompt)  # type: ignore[arg-type]
    return request


def chat_to_proto(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    if not body.messages:
        raise bad_request("messages is empty; send at least one message", "messages")
    max_tokens = body.max_completion_tokens
    request = _sampling(body, request_id, body.max_tokens if max_tokens is None else max_tokens)
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
        request.messages.add(role=message.role, content=content or "")
    return request


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> Usage:
    return Usage.model_construct(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails.model_construct(cached_tokens=num_cached),
    )


def final_usage(last: GenerationChunk) -> Usage:
    return usage(last.num_prompt_tokens, last.num_completion_tokens, last.num_cached_tokens)


@dataclass
class ResponseShape:
    """One request's response bodies: whole (`complete`) or as server-sent events (`event`)."""

    chat: bool
    response_id: str
    model: str
    created: int
    num_prompt_tokens: int
    include_usage: bool = False
    continuous_usage: bool = False
    num_completion_tokens: int = 0
    role_sent: bool = False

    def complete(self, text: str, last: GenerationChunk) -> Completion | ChatCompletion:
        stop_reason = last.stop_reason or None
        assert last.finish_reason is not None
        if self.chat:
            choice = ChatChoice(
                message=AssistantMessage(content=text),
                finish_reason=last.finish_reason,
                stop_reason=stop_reason,
            )
            return ChatCompletion(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[choice],
                usage=final_usage(last),
            )
        completion_choice = CompletionChoice(
            text=text, finish_reason=last.finish_reason, stop_reason=stop_reason
        )
        return Completion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[completion_choice],
            usage=final_usage(last),
        )

    def event(self, chunk: GenerationChunk) -> bytes | None:
        """The SSE event for a chunk; None for a chunk with nothing to say (text held back by
        the detokenizer), unless the client asked for usage on every chunk."""
        self.num_completion_tokens += len(chunk.token_ids)
        finish_reason = chunk.finish_reason
        if not chunk.text and finish_reason is None and not self.continuous_usage:
            return None
        chunk_usage = None
        if self.continuous_usage:
            chunk_usage = usage(self.num_prompt_tokens, self.num_completion_tokens)
        stop_reason = chunk.stop_reason or None
        body: Completion | ChatCompletionChunk
        if self.chat:
            delta = Delta.model_construct(content=chunk.text)
            if not self.role_sent:  # OpenAI names the role in the first delta only
                delta.role, self.role_sent = "assistant", True
            choice = ChatChunkChoice.model_construct(
                delta=delta, finish_reason=finish_reason, stop_reason=stop_reason
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
                text=chunk.text, finish_reason=finish_reason, stop_reason=stop_reason
            )
            body = Completion.model_construct(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[text_choice],
                usage=chunk_usage,
            )
        return sse(body.model_dump_json())

    def usage_event(self, last: GenerationChunk) -> bytes:
        """stream_options.include_usage: a last chunk with no choices and the whole usage."""
        body: Completion | ChatCompletionChunk
        kind = ChatCompletionChunk if self.chat else Completion
        body = kind.model_construct(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=final_usage(last),
        )
        return sse(body.model_dump_json())


def sse(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
