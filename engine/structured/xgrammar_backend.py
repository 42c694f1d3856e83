"""The structured-output backend on xgrammar (vLLM's and SGLang's default).

Its compiler precomputes, per grammar state, which tokens of the vocabulary are allowed
whatever follows, so filling a bitmask costs a lookup for most states; its own cache is turned
off (grammars.py keeps a bounded LRU of compiled grammars instead, counted in specs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar
from transformers import PreTrainedTokenizerBase

from engine.structured.backend import GrammarError
from engine.structured.spec import StructuredKind, StructuredOutput


class XGrammarMatcher:
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    """Compiles against one tokenizer. `vocab_size` is the model's logits width, which may
    exceed the tokenizer's (padded embeddings): the padding ids are never allowed."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        threads: int = 1,
    ) -> None:
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        self._compiler = xgrammar.GrammarCompiler(
            self.info, max_threads=threads, cache_enabled=False
        )

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        try:
            if spec.kind == StructuredKind.JSON:
                grammar = xgrammar.Grammar.from_json_schema(
                    _strict_formats(spec.value), any_whitespace=spec.any_whitespace
                )
                return compiler.compile_grammar(_strict_strings(str(grammar)))
            if spec.kind == StructuredKind.JSON_OBJECT:
                return compiler.compile_builtin_json_grammar()
            if spec.kind == StructuredKind.REGEX:
                return compiler.compile_regex(spec.value)
            if spec.kind == StructuredKind.CHOICE:
                return compiler.compile_grammar(spec.choice_grammar())
            if spec.kind == StructuredKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(spec.value)
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_message(exc)) from None

    def matcher(self, compiled: object) -> XGrammarMatcher:
        assert isinstance(compiled, xgrammar.CompiledGrammar)
        return XGrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(num_rows, self.info.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """xgrammar's batched apply: its C++ kernel on the CPU (3x faster than unpacking the
        bits in torch at batch 16 over a 49k vocabulary), its CUDA or Triton kernel on a GPU.
        Its kernels take float32, bfloat16 and float16; float64 (the parity tests) goes
        through its torch implementation."""
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        if logits.dtype == torch.float64:
            xgrammar.apply_token_bitmask_inplace(
                logits, bitmask, indices=rows, backend="torch_native"
            )
        else:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


# xgrammar (0.2.9) writes a string with length bounds as characters of _LOOSE_CHARACTER, which admits
# the other control characters JSON forbids unescaped (U+0000 to U+001F): a model that emits one
# gives text that json.loads refuses. Its unbounded strings already exclude them.
_LOOSE_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r"[^\0-\x1f\"\\]"


# Formats xgrammar writes looser than JSON Schema's checkers read them, compiled as patterns of
# what they accept instead: its ipv4 admits octets with leading zeros ("010"), which dotted-quad
# (and Python's ipaddress) refuses; its date-time admits year 0000 and fractional seconds with no
# end (a small model writes zeros until max_tokens); its date and date-time admit February 30.
# The dates below are a subset of the valid ones (no February 29): every one parses.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_MONTH_DAY = "((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
_HOUR = "([01][0-9]|2[0-3])"
_TIME = f"{_HOUR}:[0-5][0-9]:[0-5][0-9](\\.[0-9]{{1,6}})?(Z|[+-]{_HOUR}:[0-5][0-9])"
_FORMAT_PATTERNS = {
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
    "date": f"^{_YEAR}-{_MONTH_DAY}$",
    "date-time": f"^{_YEAR}-{_MONTH_DAY}T{_TIME}$",
}


def _strict_formats(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return schema_text  # xgrammar names what is wrong with it
    return json.dumps(_replace_formats(schema))


def _replace_formats(node: Any) -> Any:
    if isinstance(node, list):
        return [_replace_formats(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _replace_formats(value) for key, value in node.items()}
    pattern = _FORMAT_PATTERNS.get(node.get("format"))  # type: ignore[arg-type]
    if pattern is not None and "pattern" not in node:
        del node["format"]
        node["pattern"] = pattern
    return node


def _strict_strings(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER)


def _message(exc: Exception) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head:
            return rest.strip()
    return text
