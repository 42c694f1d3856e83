"""Structured output in the engine: outputs match their grammar, greedy under a grammar that
admits the model's own answer is that answer (with and without speculation, after preemption),
log-probabilities are those of the masked logits, and a grammar that compiles slowly holds
only its own request."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar
from transformers import AutoTokenizer

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig
from engine.structured.grammars import Grammars
from engine.structured.spec import StructuredOutput
from engine.structured.xgrammar_backend import XGrammarBackend
from tests.engine.test_llm import make_prompts
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import load_hf_model, make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "size"],
    "additionalProperties": False,
}
PROMPTS = make_prompts((4, 9, 17, 30), seed=5)
MANY_PROMPTS = make_prompts((3, 5, 7, 9, 11, 13, 15, 17, 19, 21), seed=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = make_tiny_model(tmp_path_factory.mktemp("structured"), family="llama")
    return add_tiny_tokenizer(Path(folder))


@pytest.fixture(scope="module")
def llm(model_dir: str):
    with LLM(model_dir, dtype="float64", block_size=8, num_kv_blocks=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def _text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, tokenizer, temperature: float) -> None:
    spec = StructuredOutput.json(SCHEMA, any_whitespace=False)
    params = [
        SamplingParams(max_tokens=200, structured=spec, temperature=temperature, seed=seed)
        for seed in range(len(PROMPTS))
    ]
    for out in llm.generate(PROMPTS, params):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(_text(tokenizer, out.token_ids)), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(llm, tokenizer) -> None:
    specs = {
        "regex": (StructuredOutput.regex(r"[0-9]{3}-[a-c]{2}"), lambda t: len(t) == 6),
        "choice": (
            StructuredOutput.choice(["café 🙂", "thé\t🚀"]),
            lambda t: t in ("café 🙂", "thé\t🚀"),
        ),
        "grammar": (
            StructuredOutput.grammar('root ::= "(" [xy]+ ")"'),
            lambda t: t[0] == "(" and t[-1] == ")" and set(t[1:-1]) <= {"x", "y"},
        ),
    }
    for name, (spec, check) in specs.items():
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, structured=spec))[0]
        text = _text(tokenizer, out.token_ids)
        assert out.finish_reason == "stop" and check(text), (name, text)


def test_a_cut_schema_finishes_with_length(llm) -> None:
    spec = StructuredOutput.json({"type": "array", "items": {"type": "integer"}})
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, structured=spec))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def _admitting(tokenizer, token_ids: list[int]) -> StructuredOutput:
    """A choice between the model's own output and another text: the mask must leave it be."""
    return StructuredOutput.choice([_exact(tokenizer, token_ids), "something else entirely"])


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_under_an_admitting_grammar_is_the_unconstrained_answer(
    model_dir: str, tokenizer, speculative: bool
) -> None:
    # repeated prompts give the prompt lookup something to propose
    prompts = [p + p for p in MANY_PROMPTS]
    spec_config = SpeculativeConfig(num_tokens=3) if speculative else None
    with LLM(model_dir, dtype="float64", block_size=8, speculative=spec_config) as engine:
        free = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        if speculative:
            assert sum(out.num_spec_proposed for out in free) > 0
        # up to the first special token: a grammar ends at EOS, so it admits text only
        answers = [_whole_characters(tokenizer, _before_special(o.token_ids)) for o in free]
        assert sum(len(ids) >= 4 for ids in answers) >= 2
        kept = [(p, ids) for p, ids in zip(prompts, answers, strict=True) if ids]
        params = [
            SamplingParams(max_tokens=len(ids), structured=_admitting(tokenizer, ids))
            for _, ids in kept
        ]
        constrained = engine.generate([p for p, _ in kept], params)
    assert [out.token_ids for out in constrained] == [ids for _, ids in kept]


def _before_special(token_ids: list[int]) -> list[int]:
    special = [i for i, t in enumerate(token_ids) if t in (0, 1, 2)]
    return token_ids[: special[0]] if special else token_ids


def _whole_characters(tokenizer, token_ids: list[int]) -> list[int]:
    """The longest prefix whose bytes are whole UTF-8 characters: a random model's tokens often
    end inside one, which no text (and so no choice) can spell."""
    for end in range(len(token_ids), 0, -1):
        if "\ufffd" not in _exact(tokenizer, token_ids[:end]):
            return token_ids[:end]
    return []


def _exact(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)


def test_preempted_requests_resume_under_their_grammar(model_dir: str, tokenizer) -> None:
    spec = StructuredOutput.regex("[a-z]{30}")
    params = SamplingParams(max_tokens=60, structured=spec)
    with LLM(model_dir, dtype="float64", block_size=8, num_kv_blocks=256) as roomy:
        expected = [out.token_ids for out in roomy.generate(PROMPTS, params)]
    with LLM(model_dir, dtype="float64", block_size=8, num_kv_blocks=12) as tight:
        outs = tight.generate(PROMPTS, params)
    assert sum(out.num_preemptions for out in outs) > 0
    assert [out.token_ids for out in outs] == expected
    assert all(len(_text(tokenizer, ids)) == 30 for ids in expected)


def test_logprobs_are_those_of_the_masked_logits(model_dir: str, llm) -> None:
    spec = StructuredOutput.regex(r"[a-f]{6}")
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, logprobs=2, structured=spec))[0]
    hf = load_hf_model(model_dir, torch.float64)
    backend = XGrammarBackend(AutoTokenizer.from_pretrained(model_dir), 512, [2])
    matcher = backend.matcher(backend.compile(spec))
    bitmask = backend.allocate_bitmask(1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 :]
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        matcher.fill_bitmask(bitmask, 0)
        allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(512)])
        masked = logits[i].masked_fill(allowed == 0, float("-inf")).log_softmax(-1)
        assert entry.logprob == pytest.approx(float(masked[token_id]), abs=1e-9)
        assert [t[0] for t in entry.top] == masked.topk(2).indices.tolist()
        assert matcher.accept(token_id)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_batched_apply_masks_exactly_the_refused_tokens_of_the_listed_rows(
    model_dir: str, dtype: torch.dtype
) -> None:
    backend = XGrammarBackend(AutoTokenizer.from_pretrained(model_dir), 512, [2])
    generator = torch.Generator().manual_seed(0)
    bitmask = backend.allocate_bitmask(5)
    assert bitmask.shape == (5, 16) and bool((bitmask == -1).all())
    bitmask[[1, 3]] = torch.randint(-(2**31), 2**31 - 1, (2, 16), generator=generator).int()
    logits = torch.randn(5, 512, generator=generator).to(dtype)
    masked = logits.clone()
    backend.apply_bitmask(masked, bitmask, [1, 3])
    bits = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(512)] for r in range(5)]
    )
    for row in range(5):
        refused = (bits[row] == 0) & torch.tensor(row in (1, 3))
        assert torch.equal(masked[row][~refused], logits[row][~refused])
        assert bool((masked[row][refused] == float("-inf")).all())
    assert 0 < int((bits[1] == 0).sum()) < 512


def test_a_schema_that_does_not_compile_ends_its_request_with_the_reason(llm) -> None:
    bad = StructuredOutput.json('{"type": "objekt"}')
    good, failed = llm.generate(
        PROMPTS[:2],
        [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured=bad)],
    )
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert failed.finish_reason == "error" and 'Unsupported type "objekt"' in (failed.error or "")


class _GatedBackend(XGrammarBackend):
    """xgrammar, with compiles that wait for a gate: a grammar that compiles slowly."""

    def __init__(self, model_dir: str, gate: threading.Event) -> None:
        super().__init__(AutoTokenizer.from_pretrained(model_dir), 512, [2])
        self.gate = gate

    def compile(self, spec: StructuredOutput) -> object:
        assert self.gate.wait(30), "the test never opened the gate"
        return super().compile(spec)


def test_a_request_waits_for_its_grammar_without_holding_the_batch(model_dir: str) -> None:
    gate = threading.Event()
    engine = LLMEngine(EngineConfig(model_dir=model_dir, dtype="float64", block_size=8))
    try:
        engine.grammars = Grammars(lambda: _GatedBackend(model_dir, gate))
        spec = StructuredOutput.regex("[a-z]{4}")
        engine.add_request("slow", PROMPTS[0], SamplingParams(max_tokens=4, structured=spec))
        engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
        tokens: dict[str, list[int]] = {"slow": [], "free": []}
        finished: set[str] = set()
        for _ in range(50):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished.add(out.request_id)
            if "free" in finished:
                break
        assert finished == {"free"} and len(tokens["free"]) == 4 and not tokens["slow"]
        gate.set()
        deadline = time.monotonic() + 30  # the compile loads the tokenizer first
        while "slow" not in finished and time.monotonic() < deadline:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                finished |= {out.request_id} if out.finished else set()
            time.sleep(0.001)
        text = AutoTokenizer.from_pretrained(model_dir).decode(tokens["slow"])
        assert re.fullmatch("[a-z]{4}</s>", text), text
    finally:
        gate.set()
        engine.shutdown()


def test_json_strings_and_ipv4_admit_only_what_json_schema_allows(model_dir: str) -> None:
    backend = XGrammarBackend(AutoTokenizer.from_pretrained(model_dir), 512, [2])
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 4},
            "ip": {"type": "string", "format": "ipv4"},
            "at": {"type": "string", "format": "date-time"},
        },
        "required": ["s", "ip", "at"],
    }
    compiled = backend.compile(StructuredOutput.json(schema, any_whitespace=False))

    def accepts(text: str) -> bool:
        return bool(xgrammar.GrammarMatcher(compiled).accept_string(text))

    assert accepts('{"s": "ab", "ip": "10.0.255.1", "at": "2024-05-31T23:59:59.5+01:00"}')
    assert not accepts('{"s": "a\x0e')  # a raw control character, which JSON forbids
    assert not accepts('{"s": "ab", "ip": "010.')  # a leading zero, which dotted-quad forbids
    assert not accepts('{"s": "ab", "ip": "256.')
    ok = '{"s": "ab", "ip": "1.1.1.1", "at": '
    assert not accepts(ok + '"0000-')  # year 0, which no checker parses
    assert not accepts(ok + '"2024-02-30')  # a day the month does not have
    assert not accepts(ok + '"2024-01-01T00:00:00.1234567')  # fractions end after six digits
