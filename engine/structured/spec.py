"""What a request's output must match: one frozen, hashable value that travels with its params."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


class StructuredKind(str, enum.Enum):
    JSON = "json"  # `value`: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"  # `value`: a regular expression the whole output matches
    CHOICE = "choice"  # `choices`: the output is exactly one of them
    GRAMMAR = "grammar"  # `value`: an EBNF grammar (GBNF style, rule `root`)
    STRUCTURAL_TAG = "structural_tag"  # `value`: xgrammar's structural tag, as JSON text


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output. Equal specs share one compiled grammar.

    `any_whitespace=False` makes JSON compact (one space after `:` and `,`, no newlines), as
    vLLM's `disable_any_whitespace`; the default admits any whitespace JSON allows.
    """

    kind: StructuredKind
    value: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StructuredKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == StructuredKind.CHOICE:
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("choice needs a non-empty list of non-empty strings")
        elif self.kind != StructuredKind.JSON_OBJECT and not self.value:
            raise ValueError(f"a {self.kind.value} constraint needs its {self.kind.value} text")

    @classmethod
    def json(cls, schema: str | dict[str, object], any_whitespace: bool = True) -> StructuredOutput:
        # the properties' order is the output's: never sorted
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(StructuredKind.JSON, text, any_whitespace=any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(StructuredKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls(StructuredKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls(StructuredKind.GRAMMAR, ebnf)

    @property
    def size(self) -> int:
        """Characters of its text, which the router bounds (`max_grammar_chars`)."""
        return len(self.value) + sum(len(c) for c in self.choices)

    def choice_grammar(self) -> str:
        """The choices as an EBNF alternation of string literals. JSON's escapes are EBNF's, but
        not its surrogate pairs: a character past U+FFFF is written as itself."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
