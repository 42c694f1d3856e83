"""Hypothesis strategies for GenerateRequest messages (raw wire bytes: fuzz_wire.py), and the oracle
that says what the router must answer to each: which fields it must refuse, or OK.

The oracle is written from the API's documented rules (proto/pdserve_proto/v1/generation.proto
and the limits of the tiny test model), not from router/validation.py's code, so a validator
that drifts from them fails the fuzzer. Token counts come from the same tokenizer the router uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TypeVar

from hypothesis import strategies as st
from pdserve_proto.v1 import generation_pb2 as pb

from router.tokenizer import ChatTemplateError, RouterTokenizer

VOCAB_SIZE = 512  # tests/tiny_models.py and tiny_tokenizer.py
MAX_MODEL_LEN = 512
MAX_PROMPT_CHARS = 32 * MAX_MODEL_LEN  # RouterConfig.max_prompt_chars_per_token's default
MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_CHARS = 128
VALID_MAX_TOKENS = 4  # valid requests generate at most this many tokens: the fuzzer stays fast
MAX_LOGPROBS = 20  # logprobs and prompt_logprobs, as OpenAI's top_logprobs
MAX_N = 16  # completions per request
FIELD_NAMES = tuple(field.name for field in pb.GenerateRequest.DESCRIPTOR.fields)
INPUT_FIELDS = ("prompt", "token_ids", "messages")
ROLES = ("system", "user", "assistant", "tool")
_T = TypeVar("_T")
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
# Few and large: up to 3 MB, under gRPC's 4 MB message limit with everything else a request holds.
_HUGE_SIZES = (MAX_PROMPT_CHARS + 1, 200_000, 3_000_000)


def named_fields(message: str) -> set[str]:
    """The request fields a status message names (whole words: `stop` is not `stop_token_ids`)."""
    return {name for name in FIELD_NAMES if re.search(rf"\b{name}\b", message)}


@dataclass(frozen=True)
class Expected:
    refused_for: frozenset[str]  # the fields the router may name in INVALID_ARGUMENT; empty: OK
    max_tokens: int = 0  # for an OK answer: how many tokens each completion may generate at most
    n: int = 1  # for an OK answer: how many completions (n > 1: GenerateUnary refuses `n`)


def expected(request: pb.GenerateRequest, tokenizer: RouterTokenizer) -> Expected:
    """What the router must answer: INVALID_ARGUMENT naming one of the fields that break a rule
    (the validator stops at the first it meets, so any of them), or OK."""
    refused = _sampling_problems(request)
    max_tokens = request.max_tokens if request.HasField("max_tokens") else 2  # router default
    if request.HasField("min_tokens") and not 0 <= request.min_tokens <= max_tokens:
        refused.add("min_tokens")
    given = [name for name in INPUT_FIELDS if _has_input(request, name)]
    if len(given) != 1:
        refused |= set(given or INPUT_FIELDS)
        return Expected(frozenset(refused))
    num_prompt_tokens = _num_prompt_tokens(request, given[0], tokenizer)
    if num_prompt_tokens is None:
        refused.add(given[0])
    elif max_tokens >= 1 and num_prompt_tokens + max_tokens > MAX_MODEL_LEN:
        refused.add("max_tokens")  # "the prompt has N tokens and max_tokens is M: together..."
    n = request.n if request.HasField("n") else 1
    return Expected(frozenset(refused), max_tokens, n)


def _has_input(request: pb.GenerateRequest, name: str) -> bool:
    return bool(request.prompt) if name == "prompt" else len(getattr(request, name)) > 0


def _sampling_problems(request: pb.GenerateRequest) -> set[str]:
    problems = set()
    request_id = request.request_id
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        problems.add("request_id")
    checks = {
        "max_tokens": lambda v: v >= 1,
        "temperature": lambda v: 0 <= v <= 100,  # false for NaN
        "top_p": lambda v: 1e-6 <= v <= 1,
        "top_k": lambda v: v >= 0,
        "seed": lambda v: v >= 0,
        "ttft_slo_s": lambda v: math.isfinite(v) and v > 0,
        "tpot_slo_s": lambda v: math.isfinite(v) and v > 0,
        "logprobs": lambda v: 0 <= v <= MAX_LOGPROBS,
        "prompt_logprobs": lambda v: 0 <= v <= MAX_LOGPROBS,
        "presence_penalty": lambda v: -2 <= v <= 2,  # false for NaN
        "frequency_penalty": lambda v: -2 <= v <= 2,
        "repetition_penalty": lambda v: 0 < v <= 100,
        "n": lambda v: 1 <= v <= MAX_N,
    }
    for name, ok in checks.items():
        if request.HasField(name) and not ok(getattr(request, name)):
            problems.add(name)
    if any(not 0 <= t < VOCAB_SIZE for t in request.stop_token_ids):
        problems.add("stop_token_ids")
    bias = request.logit_bias
    if any(not 0 <= t < VOCAB_SIZE or not -100 <= v <= 100 for t, v in bias.items()):
        problems.add("logit_bias")
    if len(request.stop) > MAX_STOP_STRINGS or not all(request.stop):
        problems.add("stop")
    return problems


def _num_prompt_tokens(
    request: pb.GenerateRequest, given: str, tokenizer: RouterTokenizer
) -> int | None:
    """The prompt's length in tokens, or None where the input itself breaks a rule."""
    if given == "prompt":
        too_long = len(request.prompt) > MAX_PROMPT_CHARS
        return None if too_long else len(tokenizer.encode(request.prompt))
    if given == "token_ids":
        ids = request.token_ids
        ok = len(ids) <= MAX_MODEL_LEN and all(0 <= t < VOCAB_SIZE for t in ids)
        return len(ids) if ok else None
    messages = request.messages
    if any(m.role not in ROLES for m in messages):
        return None
    if sum(len(m.content) for m in messages) > MAX_PROMPT_CHARS:
        return None
    try:
        num_tokens = len(tokenizer.encode_chat([(m.role, m.content) for m in messages]))
    except ChatTemplateError:
        return None
    return num_tokens or None


# -- request messages ------------------------------------------------------------------------


_texts = st.text(max_size=24)
_huge_texts = st.tuples(st.sampled_from(_HUGE_SIZES), st.sampled_from("aé中🙂")).map(
    lambda size_char: size_char[1] * (size_char[0] // len(size_char[1].encode()))
)
# At most one field of a request is huge, and only one request in about 50 has one: huge values
# cost time to build and send, and two of them could pass gRPC's 4 MB limit together.
_HUGE_FIELDS = ("prompt", "token_ids", "messages", "stop", "request_id")
_huge_field = st.integers(0, 49).flatmap(
    lambda n: st.sampled_from(_HUGE_FIELDS) if n == 0 else st.none()
)
_token_ids = st.integers(0, VOCAB_SIZE - 1)


def _mostly(valid: st.SearchStrategy[_T], other: st.SearchStrategy[_T]) -> st.SearchStrategy[_T]:
    """`valid` nine times in ten, else `other` (out of range, or anything): with about ten
    fields, a third of the requests are valid, and each rule is broken alone as well as with
    others."""
    return st.integers(0, 9).flatmap(lambda n: other if n == 0 else valid)


_any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 1e-7, 100.5, 5e-324, -math.inf, math.inf, math.nan]),
)


def _ints_but(low: int, high: int, bounds: tuple[int, int]) -> st.SearchStrategy[int]:
    """Integers in `bounds` outside [low, high], the ones next to the range most of all."""
    edges = [v for v in (low - 1, high + 1, bounds[0], bounds[1]) if bounds[0] <= v <= bounds[1]]
    return st.one_of(st.sampled_from(edges), st.integers(*bounds))


def _floats_but(low: float, high: float) -> st.SearchStrategy[float]:
    edges = [math.nextafter(low, -math.inf), math.nextafter(high, math.inf), -low, -high]
    return st.one_of(st.sampled_from(edges), _any_float)


_SAMPLING = {
    # Never 5 to 511: a valid request generates few tokens, and 512 is over with any prompt.
    "max_tokens": _mostly(
        st.integers(1, VALID_MAX_TOKENS),
        st.sampled_from([0, MAX_MODEL_LEN])
        | st.integers(_INT32[0], 0)
        | st.integers(MAX_MODEL_LEN, _INT32[1]),
    ),
    "temperature": _mostly(
        st.sampled_from([0.0, 1e-6, 100.0]) | st.floats(0, 100), _floats_but(0, 100)
    ),
    "top_p": _mostly(st.sampled_from([1e-6, 1.0]) | st.floats(1e-6, 1), _floats_but(1e-6, 1)),
    "top_k": _mostly(st.integers(0, 50), _ints_but(0, _INT32[1], _INT32)),
    "seed": _mostly(st.integers(0, _INT64[1]), _ints_but(0, _INT64[1], _INT64)),
}
# The API fields vLLM users send: set less often (a quarter of the time each), so a third of the
# requests stay valid; n small, so a valid request stays quick.
_OUTPUT = {
    "logprobs": _mostly(st.integers(0, MAX_LOGPROBS), _ints_but(0, MAX_LOGPROBS, _INT32)),
    "prompt_logprobs": _mostly(st.integers(0, MAX_LOGPROBS), _ints_but(0, MAX_LOGPROBS, _INT32)),
    "presence_penalty": _mostly(st.floats(-2, 2), _floats_but(-2, 2)),
    "frequency_penalty": _mostly(st.floats(-2, 2), _floats_but(-2, 2)),
    "repetition_penalty": _mostly(
        st.floats(1e-3, 100) | st.just(100.0), _floats_but(1e-300, 100) | st.just(0.0)
    ),
    "min_tokens": _mostly(st.integers(0, VALID_MAX_TOKENS), _ints_but(0, 2, _INT32)),
    "n": _mostly(st.integers(1, 3), _ints_but(1, MAX_N, _INT32)),
    "ttft_slo_s": _mostly(st.floats(1e-3, 60), st.sampled_from([0.0, -1.0, math.inf, math.nan])),
    "tpot_slo_s": _mostly(st.floats(1e-3, 1), st.sampled_from([0.0, -1.0, math.inf, math.nan])),
}
_vocab_but = _ints_but(0, VOCAB_SIZE - 1, _INT32)
_stop_lists = _mostly(
    st.lists(_texts.filter(bool), max_size=3),
    st.lists(st.one_of(_texts, _texts.map(lambda t: t * 50)), max_size=40),
)
_request_ids = _mostly(
    st.one_of(st.just(""), st.text(st.characters(codec="ascii", categories=["L", "N"]))),
    st.one_of(_texts, st.text(min_size=120, max_size=140)),
)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Every field, each set or not, with valid, edge and out-of-range values."""
    request = pb.GenerateRequest()
    huge = draw(_huge_field)
    one_input = st.sampled_from(INPUT_FIELDS).map(lambda name: {name})
    inputs = draw(_mostly(one_input, st.sets(st.sampled_from(INPUT_FIELDS), max_size=3)))
    if "prompt" in inputs:
        request.prompt = draw(_huge_texts if huge == "prompt" else _texts.filter(bool))
    if "token_ids" in inputs:
        ids = st.lists(_mostly(_token_ids, _vocab_but), min_size=1, max_size=8)
        if huge == "token_ids":
            ids = st.sampled_from([MAX_MODEL_LEN - 1, MAX_MODEL_LEN + 1, 400_000]).map(
                lambda n: [5] * n
            )
        request.token_ids.extend(draw(ids))
    if "messages" in inputs:
        role = _mostly(st.sampled_from(ROLES), _texts)
        for role_value, text in draw(st.lists(st.tuples(role, _texts), min_size=1, max_size=3)):
            request.messages.append(pb.ChatMessage(role=role_value, content=text))
        if huge == "messages":
            request.messages[-1].content = draw(_huge_texts)
    _draw_sampling(draw, request, huge)
    return request


def _draw_sampling(draw: st.DrawFn, request: pb.GenerateRequest, huge: str | None) -> None:
    for name, values in _SAMPLING.items():
        if draw(st.booleans()):
            setattr(request, name, draw(values))
    for name, values in _OUTPUT.items():
        if draw(st.integers(0, 3)) == 0:
            setattr(request, name, draw(values))
    if draw(st.integers(0, 3)) == 0:
        biases = st.dictionaries(
            _mostly(_token_ids, _vocab_but), _mostly(st.floats(-100, 100), _floats_but(-100, 100))
        )
        request.logit_bias.update(draw(biases.filter(lambda b: len(b) <= 3)))
    request.stop.extend(draw(_stop_lists if huge != "stop" else _huge_texts.map(lambda t: [t])))
    stop_ids = st.lists(_mostly(_token_ids, _vocab_but), max_size=3)
    request.stop_token_ids.extend(draw(st.one_of(st.just([]), stop_ids)))
    request.ignore_eos = draw(st.booleans())
    request.request_id = draw(_huge_texts if huge == "request_id" else _request_ids)
