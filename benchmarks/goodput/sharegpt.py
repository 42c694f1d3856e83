"""Read a ShareGPT-format JSON file the way vLLM's benchmark_serving does.

The file is a list of conversations:

    [{"id": "...", "conversations": [{"from": "human", "value": "prompt text"},
                                     {"from": "gpt", "value": "answer text"}, ...]}, ...]

The first human turn is the prompt; the first gpt turn after it gives the target output length
(its token count with the model's tokenizer). Structural problems (not a list, a missing key, a
value of the wrong type) reject the whole file with a message naming the entry and the key;
conversations without a human turn followed by a gpt turn are skipped, as vLLM skips them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_TOKENS = 4  # vLLM drops prompts or answers shorter than this: too short to mean anything


class ShareGPTError(ValueError):
    """The file is not ShareGPT-format; the message names the entry and what is wrong."""


def _check_turn(entry_index: int, turn_index: int, turn: Any) -> tuple[str, str]:
    where = f"entry {entry_index}, conversations[{turn_index}]"
    if not isinstance(turn, dict):
        raise ShareGPTError(f"{where}: a turn must be an object, got {type(turn).__name__}")
    for key in ("from", "value"):
        if key not in turn:
            raise ShareGPTError(f"{where}: missing key {key!r} (a turn has 'from' and 'value')")
        if not isinstance(turn[key], str):
            raise ShareGPTError(
                f"{where}: {key!r} must be a string, got {type(turn[key]).__name__}"
            )
    return turn["from"], turn["value"]


def _first_exchange(entry_index: int, entry: Any) -> tuple[str, str] | None:
    """(prompt, answer) of one conversation, or None when it has no human -> gpt exchange."""
    if not isinstance(entry, dict):
        raise ShareGPTError(f"entry {entry_index}: must be an object, got {type(entry).__name__}")
    if "conversations" not in entry:
        raise ShareGPTError(f"entry {entry_index}: missing key 'conversations'")
    turns = entry["conversations"]
    if not isinstance(turns, list):
        raise ShareGPTError(
            f"entry {entry_index}: 'conversations' must be a list, got {type(turns).__name__}"
        )
    checked = [_check_turn(entry_index, i, turn) for i, turn in enumerate(turns)]
    prompt = None
    for role, value in checked:
        if role == "human" and prompt is None:
            prompt = value
        elif role == "gpt" and prompt is not None:
            return prompt, value
    return None


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """Every (prompt, answer) pair of the file, in file order. Raises ShareGPTError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ShareGPTError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ShareGPTError(
            f"{path}: the top level must be a list of conversations, got {type(data).__name__}"
        )
    pairs = [pair for i, entry in enumerate(data) if (pair := _first_exchange(i, entry))]
    if not pairs:
        raise ShareGPTError(f"{path}: no conversation has a human turn followed by a gpt turn")
    return pairs


def sharegpt_prompts(
    pairs: list[tuple[str, str]],
    encode: Callable[[str, bool], list[int]],
    num_requests: int,
    max_model_len: int,
    seed: int,
) -> list[tuple[list[int], int]]:
    """`num_requests` (prompt token ids, output length) drawn from the usable pairs.

    `encode(text, add_special_tokens)` is the model's tokenizer: the prompt is encoded as the
    router would (with BOS), the answer only counted. A pair is usable when prompt and answer
    have >= MIN_TOKENS tokens and prompt + answer fit in `max_model_len` (as vLLM filters).
    Pairs are shuffled with `seed` and reused in that order when the file has fewer usable
    pairs than requests.
    """
    usable = []
    for prompt, answer in pairs:
        prompt_ids, output_len = encode(prompt, True), len(encode(answer, False))
        if len(prompt_ids) < MIN_TOKENS or output_len < MIN_TOKENS:
            continue
        if len(prompt_ids) + output_len > max_model_len:
            continue
        usable.append((prompt_ids, output_len))
    if not usable:
        raise ShareGPTError(
            f"none of the {len(pairs)} conversations fits: each needs >= {MIN_TOKENS} prompt and "
            f"answer tokens and prompt + answer <= {max_model_len} tokens"
        )
    random.Random(seed).shuffle(usable)
    return [usable[i % len(usable)] for i in range(num_requests)]
