"""A request's structured-output constraint, read from the API and compiled before dispatch.

The router compiles every spec it has not seen, against the model's tokenizer, so that a schema,
regex or grammar that does not compile (or takes longer than `grammar_compile_timeout_s`) is
answered with INVALID_ARGUMENT (HTTP 400) naming the reason, instead of failing on a worker.
A compile that overruns goes on in the background: its spec stays cached, and once compiled it
is accepted. The workers compile the same spec again into their own caches (engine/structured);
what crosses to them is the spec, never a compiled grammar.
"""

from __future__ import annotations

import asyncio
import json

from pdserve_proto.v1 import generation_pb2 as pb

from engine.structured.backend import GrammarBackend
from engine.structured.grammars import Grammars
from engine.structured.spec import StructuredKind, StructuredOutput
from router.config import RouterConfig
from router.tokenizer import RouterTokenizer

_CACHED_SPECS = 1024  # specs compiled once here; repeats are checked at no cost


class InvalidStructuredOutput(ValueError):
    """The constraint is malformed or does not compile; the message names the field and why."""


def spec_from_request(request: pb.GenerateRequest) -> StructuredOutput | None:
    """The request's constraint, or None when it sets none."""
    if not request.HasField("structured_output"):
        return None
    message = request.structured_output
    which = message.WhichOneof("constraint")
    field = f"structured_output.{which}"
    any_whitespace = not message.compact_json
    if which is None:
        raise InvalidStructuredOutput(
            "structured_output sets no constraint: set one of json_schema, json_object, regex, "
            "choice or grammar"
        )
    if which == "json_schema":
        try:
            schema = json.loads(message.json_schema)
        except json.JSONDecodeError as exc:
            raise InvalidStructuredOutput(f"{field} is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidStructuredOutput(f"{field} must be a JSON object (a schema)")
        return StructuredOutput.json(message.json_schema, any_whitespace=any_whitespace)
    if which == "json_object":
        if not message.json_object:
            raise InvalidStructuredOutput(f"{field} must be true when set")
        return StructuredOutput(StructuredKind.JSON_OBJECT, any_whitespace=any_whitespace)
    if which == "choice":
        choices = list(message.choice.choices)
        if not choices or not all(choices):
            raise InvalidStructuredOutput(f"{field} must list at least one non-empty string")
        return StructuredOutput.choice(choices)
    text = getattr(message, which)
    if not text:
        raise InvalidStructuredOutput(f"{field} is empty")
    return StructuredOutput(StructuredKind(which), text)


class GrammarCheck:
    """Compiles specs off the event loop, within a deadline, and remembers the ones that did."""

    def __init__(self, config: RouterConfig, tokenizer: RouterTokenizer, vocab_size: int) -> None:
        self._config = config
        self._grammars = Grammars(lambda: self._backend(tokenizer, vocab_size), _CACHED_SPECS)

    @staticmethod
    def _backend(tokenizer: RouterTokenizer, vocab_size: int) -> GrammarBackend:
        from engine.structured.xgrammar_backend import XGrammarBackend

        hf = tokenizer.hf_tokenizer
        stop_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
        return XGrammarBackend(hf, vocab_size, stop_ids)

    async def check(self, spec: StructuredOutput, field: str) -> None:
        config = self._config
        if spec.size > config.max_grammar_chars:
            raise InvalidStructuredOutput(
                f"{field} has {spec.size} characters, over the limit of "
                f"{config.max_grammar_chars} (router.max_grammar_chars)"
            )
        future = self._grammars.compile(spec)
        timeout_s = config.grammar_compile_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            raise InvalidStructuredOutput(
                f"{field} did not compile within {timeout_s:g} s "
                "(router.grammar_compile_timeout_s): simplify it"
            ) from None
        except ValueError as exc:  # GrammarError
            raise InvalidStructuredOutput(f"{field} does not compile: {exc}") from None

    def close(self) -> None:
        self._grammars.shutdown()
