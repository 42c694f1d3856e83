"""The ShareGPT loader on files the tests carry (tests/benchmarks/data/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.goodput.sharegpt import ShareGPTError, load_sharegpt, sharegpt_prompts

DATA = Path(__file__).parent / "data"


def test_first_human_turn_is_the_prompt_and_first_gpt_turn_after_it_the_answer() -> None:
    pairs = load_sharegpt(DATA / "sharegpt_small.json")
    assert len(pairs) == 4  # conv-2 has no human turn: skipped, as vLLM skips it
    assert pairs[0][0].startswith("What is disaggregated serving")
    assert pairs[1] == (
        "Write a Python function that returns the n-th Fibonacci number.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
        "fibonacci(n - 2)",
    )  # the system turn is ignored and the second exchange is not used
    assert pairs[3] == ("Hi", "Hi")


def word_encoder(text: str, add_special_tokens: bool) -> list[int]:
    """One token per word, BOS (1) first when asked: lengths are easy to state exactly."""
    return ([1] if add_special_tokens else []) + [len(word) + 3 for word in text.split()]


def test_prompts_are_tokenized_and_filtered_like_vllm() -> None:
    pairs = load_sharegpt(DATA / "sharegpt_small.json")
    prompts = sharegpt_prompts(pairs, word_encoder, num_requests=6, max_model_len=40, seed=0)
    # (prompt tokens incl. BOS, answer tokens): conv-0 (13, 22), conv-1 (11, 16), conv-3 (23, 7);
    # conv-4 ("Hi"/"Hi": 2 and 1) is shorter than MIN_TOKENS.
    assert [(len(ids), out) for ids, out in prompts] == [(23, 7), (13, 22), (11, 16)] * 2
    assert all(ids[0] == 1 for ids, _ in prompts)
    # With 30 tokens of context conv-0 (13 + 22 = 35) no longer fits.
    tight = sharegpt_prompts(pairs, word_encoder, num_requests=2, max_model_len=30, seed=0)
    assert sorted((len(ids), out) for ids, out in tight) == [(11, 16), (23, 7)]


def test_a_turn_without_value_is_rejected_naming_entry_and_key() -> None:
    with pytest.raises(ShareGPTError, match=r"entry 1, conversations\[1\]: missing key 'value'"):
        load_sharegpt(DATA / "sharegpt_malformed.json")


@pytest.mark.parametrize(
    "content,message",
    [
        ({"conversations": []}, "the top level must be a list of conversations, got dict"),
        ([{"id": "a"}], "entry 0: missing key 'conversations'"),
        ([{"conversations": "hi"}], "entry 0: 'conversations' must be a list, got str"),
        ([{"conversations": [{"from": "human", "value": 3}]}], "'value' must be a string, got int"),
        ([{"conversations": ["hi"]}], r"entry 0, conversations\[0\]: a turn must be an object"),
        ([{"conversations": [{"from": "gpt", "value": "x"}]}], "no conversation has a human turn"),
    ],
)
def test_malformed_files_say_what_is_wrong(tmp_path: Path, content: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ShareGPTError, match=message):
        load_sharegpt(path)


def test_invalid_json_and_nothing_usable_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[{"conversations": [')
    with pytest.raises(ShareGPTError, match="is not valid JSON"):
        load_sharegpt(path)
    pairs = load_sharegpt(DATA / "sharegpt_small.json")
    with pytest.raises(ShareGPTError, match="none of the 4 conversations fits"):
        sharegpt_prompts(pairs, word_encoder, 3, max_model_len=8, seed=0)
