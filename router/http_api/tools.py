"""OpenAI tool calling on the chat endpoint: the request's tools and tool_choice, the constraint
each choice becomes, and the answer's `tool_calls`, whole or streamed.

    tool_choice  constraint on the output                       the answer
    none         none                                           content
    auto         none; the template's format (tool_parsers.py)  content and/or tool_calls
    required     a JSON array of {"name", "parameters"}, one    tool_calls, finish_reason
                 item per call, each item one tool's schema     "tool_calls"
                 (one item when parallel_tool_calls is false)
    {"type": "function", "function": {"name": f}}
                 f's parameters schema: the output is the       one call of f, finish_reason
                 arguments                                       "stop" (as OpenAI)

The tools are always rendered by the chat template (router/chat.py). A named function that is
not among the tools, `auto` for a model whose template teaches no tool format, or a tool choice
beside another constraint (response_format, guided_*) is a 400 naming the field. Streaming: a
named call's arguments stream as they come; `required` and `auto` calls are sent whole when the
text ends (content before an `auto` call streams as it comes).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve_proto.v1 import generation_pb2 as pb
from pydantic import BaseModel, ConfigDict, StrictBool

from router.http_api.structured import ConstraintConflict
from router.http_api.tool_parsers import ParsedCall, ToolParser


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Fields):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Fields):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Fields):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Fields):
    """An earlier call in the conversation (an assistant message's `tool_calls`)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(_Fields):
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def tool_protos(self) -> list[pb.Tool]:
        return [
            pb.Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters=json.dumps(t.function.parameters or {}),
            )
            for t in self.tools or ()
        ]

    def tool_mode(self, parser: ToolParser | None) -> ToolMode | None:
        """How the answer is shaped; None when tools play no part (none given, or `none`)."""
        choice = self.tool_choice
        if choice is not None and not self.tools and choice != "none":
            raise ConstraintConflict("tool_choice needs tools: list the functions", "tool_choice")
        if not self.tools or choice == "none":
            return None
        names = [t.function.name for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in names:
                raise ConstraintConflict(
                    f"tool_choice names {name!r}, which is not among the tools {names}",
                    "tool_choice",
                )
            return ToolMode("named", name=name)
        if choice == "required":
            return ToolMode("required")
        if parser is None:
            raise ConstraintConflict(
                "tool_choice auto needs a tool-call format in the model's chat template, and "
                "this model's teaches none: use tool_choice required or a named function",
                "tool_choice",
            )
        return ToolMode("auto", parser=parser)

    def tool_constraint(self, mode: ToolMode) -> pb.StructuredOutput | None:
        tools = {
            t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or ()
        }
        if mode.kind == "named":
            return pb.StructuredOutput(json_schema=json.dumps(tools[mode.name]))
        if mode.kind != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in tools.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return pb.StructuredOutput(json_schema=json.dumps(schema))


@dataclass(frozen=True)
class ToolMode:
    kind: Literal["auto", "required", "named"]
    name: str = ""  # the named function
    parser: ToolParser | None = None  # auto's


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_entry(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": _call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        entry["index"] = index
    return entry


@dataclass
class _Streamed:
    text: str = ""  # all of the choice's text so far
    sent: int = 0  # characters of it sent as content (auto) or arguments (named)
    started: bool = False  # a named call's first delta went out


@dataclass
class ToolReply:
    """Shapes one request's choices under its ToolMode."""

    mode: ToolMode
    streams: dict[int, _Streamed] = field(default_factory=dict)

    def _calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        mode = self.mode
        if mode.kind == "named":
            return None, [ParsedCall(mode.name, text)]
        if mode.kind == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut by max_tokens: the text as it came
            return None, [ParsedCall(i["name"], json.dumps(i["parameters"])) for i in items]
        assert mode.parser is not None
        content, calls = mode.parser.parse(text)
        return (content or None) if calls else text, calls

    def _finish_reason(self, calls: list[ParsedCall], finish_reason: str) -> str:
        if calls and finish_reason == "stop" and self.mode.kind != "named":
            return "tool_calls"
        return finish_reason

    def message(
        self, text: str, finish_reason: str
    ) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """A whole choice: (content, tool_calls, finish_reason)."""
        if self.mode.kind != "named" and finish_reason != "stop":
            return text, None, finish_reason  # cut short: no call to read
        content, calls = self._calls(text)
        entries = [_call_entry(call) for call in calls] or None
        return content, entries, self._finish_reason(calls, finish_reason)

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """One streamed chunk of choice `index`: (content, tool_calls, finish_reason)."""
        state = self.streams.setdefault(index, _Streamed())
        state.text += text
        if self.mode.kind == "named":
            new = state.text[state.sent :]
            state.sent = len(state.text)
            if not state.started:
                state.started = True
                return None, [_call_entry(ParsedCall(self.mode.name, new), 0)], finish_reason
            if new:
                return None, [{"index": 0, "function": {"arguments": new}}], finish_reason
            return None, None, finish_reason
        content = None
        if finish_reason is None:
            safe = len(state.text)
            if self.mode.kind == "required":
                safe = 0
            elif self.mode.parser is not None:
                safe = self.mode.parser.safe_prefix(state.text)
            if safe > state.sent:
                content, state.sent = state.text[state.sent : safe], safe
            return content, None, None
        rest = state.text[state.sent :]
        whole_content, calls = self._calls(state.text) if finish_reason == "stop" else (None, [])
        if not calls:
            return rest or None, None, finish_reason
        # the content before the calls went out already, as far as it was surely content
        tail = (whole_content or "")[state.sent :] or None
        entries = [_call_entry(call, i) for i, call in enumerate(calls)]
        return tail, entries, self._finish_reason(calls, finish_reason)
