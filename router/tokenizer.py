"""The model's Hugging Face tokenizer and the few facts about the model the router checks against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The messages could not be rendered (no template, or the template rejected them)."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_model_len: int  # prompt + generated tokens


def load_model_limits(model_dir: str, max_model_len: int | None = None) -> ModelLimits:
    """Read vocab size and maximum length from the model's config.json."""
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    model_len = max_model_len or getattr(config, "max_position_embeddings", None)
    if not model_len:
        raise ValueError(
            f"{model_dir}/config.json has no max_position_embeddings; set max_model_len"
        )
    return ModelLimits(vocab_size=int(config.vocab_size), max_model_len=int(model_len))


class RouterTokenizer:
    """Encode prompts, render chat messages and decode ids with the model folder's tokenizer.

    Decoding skips special tokens (BOS/EOS and the like), as OpenAI-style servers do; the
    incremental detokenizer and any client comparing against `decode(all ids)` use the same rule.
    """

    def __init__(self, model_dir: str) -> None:
        self._tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        # The Rust tokenizer, when there is one: decoding through it skips a Python layer that
        # costs more than the decode itself on short windows. That layer only adds the space
        # clean-up some tokenizers ask for, so keep it for them.
        backend = getattr(self._tokenizer, "_tokenizer", None)
        cleans_up = getattr(self._tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_backend = None if cleans_up else backend

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    def encode(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]] | Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render messages (role and content pairs, or the template's own message dicts) and
        any tools with the chat template, plus the assistant's turn, and encode them."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise ChatTemplateError("this model has no chat template; send `prompt` instead")
        conversation = [
            dict(m) if isinstance(m, Mapping) else {"role": m[0], "content": m[1]} for m in messages
        ]
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises its own errors for messages it refuses
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        # The template writes any BOS itself; adding special tokens again would double it.
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._fast_backend is not None:
            return self._fast_backend.decode(list(token_ids), skip_special_tokens=True)
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text
