"""Tool calls read out of a model's text, in the formats the supported families' chat templates
teach (`tool_choice: auto`):

    hermes       Qwen2, Qwen2.5, Qwen3 (and Hermes): <tool_call>{"name": .., "arguments": {..}}</tool_call>
    llama3_json  Llama 3.1+: {"name": .., "parameters": {..}}, optionally after <|python_tag|>,
                 several separated by ";"

A parser splits a finished text into its content and its calls, and says, for streaming, how
much of a text so far is surely content (the rest may be the start of a call, held back until
the text ends). The format is chosen from the chat template (`parser_for_template`); a template
that teaches neither has none, and `auto` is refused for it by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a finished text; with no well-formed call, (text, [])."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How many leading characters of an unfinished text are content whatever follows."""
        raise NotImplementedError


def _call(obj: object, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            return ParsedCall(obj["name"], text)
    return ParsedCall(obj["name"], "{}")


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls = []
        for match in self._BLOCK.finditer(text):
            try:
                call = _call(json.loads(match.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed block: the text as the model wrote it
            calls.append(call)
        if not calls:
            return text, []
        return text[: text.index(self.OPEN)].strip(), calls

    def safe_prefix(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        # a tail that may grow into the tag is held back
        for size in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return "", calls

    def safe_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped:
            return 0
        if stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return 0  # a call starts the text: hold it all
        return len(text)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for_template(template: str | None) -> ToolParser | None:
    """The tool-call format the chat template teaches, or None when it teaches none."""
    if not template:
        return None
    if HermesParser.OPEN in template:
        return HermesParser()
    if Llama3JsonParser.TAG in template or (
        "Environment: ipython" in template and "parameters" in template
    ):
        return Llama3JsonParser()
    return None
