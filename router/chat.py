"""A request's chat messages and tools as the Hugging Face chat template takes them.

    conversation, tools = chat_inputs(request.messages, request.tools)
    tokenizer.encode_chat(conversation, tools)

An assistant message's earlier tool calls become `tool_calls` entries whose `arguments` are the
parsed JSON object where they parse (the form templates such as Qwen's and Llama 3's expect);
a tool message keeps its `tool_call_id` and `name`. Tools become OpenAI's
`{"type": "function", "function": {...}}` entries, which the templates read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve_proto.v1 import generation_pb2 as pb


class InvalidChat(ValueError):
    """A message or tool the template cannot be given; the message names the field."""


def chat_inputs(
    messages: Sequence[pb.ChatMessage], tools: Sequence[pb.Tool]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    conversation = []
    for index, message in enumerate(messages):
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidChat(
                    f"messages[{index}].tool_calls is set on a {message.role!r} message; "
                    "only an assistant message calls tools"
                )
            turn["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.role == "tool":
            turn["tool_call_id"] = message.tool_call_id
            if message.name:
                turn["name"] = message.name
        conversation.append(turn)
    if not tools:
        return conversation, None
    rendered = []
    for index, tool in enumerate(tools):
        if not tool.name:
            raise InvalidChat(f"tools[{index}].name is empty; name the function")
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else {}
        except json.JSONDecodeError as exc:
            raise InvalidChat(f"tools[{index}].parameters is not JSON: {exc}") from None
        function = {"name": tool.name, "parameters": parameters}
        if tool.description:
            function["description"] = tool.description
        rendered.append({"type": "function", "function": function})
    return conversation, rendered


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # the template writes it as it came
