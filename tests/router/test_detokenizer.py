"""Incremental detokenizing and stop strings against the tiny model's real byte-level tokenizer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from router.stop_strings import StopCheck, StopStringMatcher
from router.tokenizer import RouterTokenizer
from tests.router.tiny_tokenizer import VOCAB_SIZE

MIXED_TEXT = "Le café 我们 🙂🚀 est très chaud, 今天天气很好."


def _stream(tokenizer: RouterTokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    return deltas + [detokenizer.flush()]


def test_multibyte_characters_split_across_tokens_are_never_split_in_deltas(
    tokenizer: RouterTokenizer,
) -> None:
    token_ids = tokenizer.encode(MIXED_TEXT)[1:]  # without BOS
    # The tokenizer really splits characters: some single tokens decode to U+FFFD alone.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in token_ids)
    deltas = _stream(tokenizer, token_ids)
    assert "".join(deltas) == MIXED_TEXT == tokenizer.decode(token_ids)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert sum(1 for d in deltas if d == "") >= 2  # it waited on incomplete characters


def test_special_tokens_are_skipped_like_decode_does(tokenizer: RouterTokenizer) -> None:
    token_ids = [1] + tokenizer.encode("hello")[1:] + [2]
    assert "".join(_stream(tokenizer, token_ids)) == "hello" == tokenizer.decode(token_ids)


@settings(max_examples=150, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40),
    chunk=st.integers(1, 4),
)
def test_concatenated_deltas_equal_decoding_all_ids(
    tokenizer: RouterTokenizer, token_ids: list[int], chunk: int
) -> None:
    deltas = _stream(tokenizer, token_ids, chunk)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    # Only the final flush may carry an unfinished character.
    assert not any(delta.endswith(REPLACEMENT_CHAR) for delta in deltas[:-1])


def test_stop_string_split_across_deltas_is_cut_exactly() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    outputs = [matcher.add(d) for d in ["Hello S", "T", "O", "P and more"]]
    assert [o.text for o in outputs] == ["Hello ", "", "", ""]
    assert [o.stop_string for o in outputs] == [None, None, None, "STOP"]


def test_held_text_that_turns_out_not_to_stop_is_released_in_order() -> None:
    matcher = StopStringMatcher(["STOP"])
    outputs = [matcher.add(d) for d in ["ab ST", "OX c", "S"]]
    assert [o.text for o in outputs] == ["ab ", "STOX c", ""]
    assert matcher.flush() == "S"


def test_the_stop_string_that_ends_first_wins_and_text_after_it_is_dropped() -> None:
    matcher = StopStringMatcher(["world", "lo w", "hello world"])
    check = matcher.add("hello world")
    assert (check.text, check.stop_string) == ("hel", "lo w")
    # Whether "ab" arrives in one delta or two, "b" ends before "abc" could: same cut.
    assert StopStringMatcher(["abc", "b"]).add("abc") == StopCheck("a", "b", num_after=1)
    split = StopStringMatcher(["abc", "b"])
    assert [split.add("a"), split.add("bc")] == [StopCheck(""), StopCheck("a", "b", 1)]


def _cut_character_by_character(text: str, stop_strings: list[str]) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop_strings if text[:end].endswith(s)]
        if ending_here:
            longest = max(ending_here, key=len)
            return text[: end - len(longest)], longest
    return text, None


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abS TOP\n中🙂", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    stop_strings=st.lists(st.text(alphabet="abSTOP\n中🙂", min_size=1, max_size=4), max_size=3),
)
def test_streamed_stop_matching_equals_cutting_the_whole_text(
    text: str, cuts: list[int], stop_strings: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    matcher = StopStringMatcher(stop_strings)
    emitted, stopped = "", None
    for start, end in zip(bounds, bounds[1:], strict=False):
        check = matcher.add(text[start:end])
        emitted += check.text
        if check.stop_string is not None:
            stopped = check.stop_string
            break
    if stopped is None:
        emitted += matcher.flush()
    assert (emitted, stopped) == _cut_character_by_character(text, stop_strings)
