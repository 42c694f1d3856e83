"""The OpenAI API's structured-output fields, and vLLM's, into the router's StructuredOutput.

    response_format: {"type": "json_object"}
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...,
                         "disable_any_whitespace": bool}                       (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar                   (vLLM's older names)

At most one constraint per request: two (a response_format and a guided_regex, say) are a 400
naming both, never a guess at which one wins. The schema is sent on as JSON text; whether it
compiles is the router's check (router/structured.py), answered with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pdserve_proto.v1 import generation_pb2 as pb
from pydantic import BaseModel, ConfigDict, Field, StrictBool


class ConstraintConflict(ValueError):
    """Two fields constrain the output, or one is incomplete: a 400 about `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Fields):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Fields):
    """vLLM's `structured_outputs` (its StructuredOutputsParams)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class StructuredFields(_Fields):
    """The constraint fields both endpoints take."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> pb.StructuredOutput | None:
        """The one constraint the request sets, or None; a 400 when it sets two."""
        found = self._constraints()
        if len(found) > 1:
            names = " and ".join(name for name, _ in found)
            raise ConstraintConflict(f"{names} both constrain the output: send one", found[1][0])
        if not found:
            return None
        constraint = found[0][1]
        constraint.compact_json = bool(
            self.structured_outputs and self.structured_outputs.disable_any_whitespace
        )
        return constraint

    def constraint_field(self) -> str | None:
        """The field that set the request's constraint (what a 400 about it names)."""
        found = self._constraints()
        return found[0][0] if found else None

    def _constraints(self) -> list[tuple[str, pb.StructuredOutput]]:
        found: list[tuple[str, pb.StructuredOutput]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", pb.StructuredOutput(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ConstraintConflict(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format.json_schema",
                )
            text = json.dumps(fmt.json_schema.json_schema)
            found.append(("response_format", pb.StructuredOutput(json_schema=text)))
        named: list[tuple[str, Any, str]] = [
            ("guided_json", self.guided_json, "json_schema"),
            ("guided_regex", self.guided_regex, "regex"),
            ("guided_choice", self.guided_choice, "choice"),
            ("guided_grammar", self.guided_grammar, "grammar"),
        ]
        outputs = self.structured_outputs
        if outputs is not None:
            named += [
                ("structured_outputs.json", outputs.json_schema, "json_schema"),
                ("structured_outputs.regex", outputs.regex, "regex"),
                ("structured_outputs.choice", outputs.choice, "choice"),
                ("structured_outputs.grammar", outputs.grammar, "grammar"),
                ("structured_outputs.json_object", outputs.json_object or None, "json_object"),
            ]
        for field, value, kind in named:
            if value is not None:
                found.append((field, _constraint(kind, value)))
        return found


def _constraint(kind: str, value: Any) -> pb.StructuredOutput:
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    return pb.StructuredOutput(**{kind: value})
