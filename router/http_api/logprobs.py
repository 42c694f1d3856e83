"""The engine's log-probabilities in OpenAI's shapes (and vLLM's prompt_logprobs).

A token's text is what the tokenizer decodes for that one id, special tokens included (an EOS
the model weighed is named). In the completions shape, `top_logprobs` maps texts to logprobs;
two ids with the same text keep the likelier. With `echo`, the prompt's tokens come first; the
first has no context and so no logprob (None), as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from engine.outputs import TokenLogprob
from router.http_api.schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from router.tokenizer import RouterTokenizer


class LogprobsWriter:
    def __init__(self, tokenizer: RouterTokenizer) -> None:
        hf = tokenizer.hf_tokenizer

        @lru_cache(maxsize=65536)
        def token_text(token_id: int) -> str:
            return str(hf.decode([token_id], skip_special_tokens=False))

        self.token_text = token_text

    def completion(
        self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], offset: int = 0
    ) -> CompletionLogprobs:
        """`token_ids[i]` is the token of `entries[i]` (an entry is None for the first prompt
        token); text offsets start at `offset`."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for top_id, logprob in entry.top:
                top.setdefault(self.token_text(top_id), logprob)
            tops.append(top)
        return CompletionLogprobs.model_construct(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
        )

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text = self.token_text(entry.token_id)
            tops = [
                TopLogprob.model_construct(
                    token=(top_text := self.token_text(t)),
                    logprob=v,
                    bytes=list(top_text.encode()),
                )
                for t, v in entry.top
            ]
            content.append(
                ChatTokenLogprob.model_construct(
                    token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=tops
                )
            )
        return ChatLogprobs.model_construct(content=content)

    def prompt(self, entries: Sequence[TokenLogprob | None]) -> PromptLogprobs:
        """vLLM's prompt_logprobs: per prompt token, its own entry and its top ones by id."""
        result: PromptLogprobs = []
        for entry in entries:
            if entry is None:
                result.append(None)
                continue
            by_id = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                by_id.setdefault(token_id, (logprob, rank))
            result.append(
                {
                    str(token_id): PromptLogprob.model_construct(
                        logprob=logprob, rank=rank, decoded_token=self.token_text(token_id)
                    )
                    for token_id, (logprob, rank) in by_id.items()
                }
            )
        return result
