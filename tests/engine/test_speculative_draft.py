"""Speculative decoding with a draft model, offline through engine.LLM: greedy output
token-identical to transformers in float64 and to non-speculative decoding; the draft's own
paged KV rolled back, and every block of both pools back after finishes, stops, preemption
and aborts.

Two drafts per model: a layer-skip self-draft (its first layer, engine/speculative/layer_skip.py),
which the random weights make agree with the target now and then, so both sides of
verification run; and the target itself, which greedy verification must accept whole.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm import LLMEngine
from engine.speculative.config import SpeculativeConfig
from engine.speculative.layer_skip import build_layer_skip_draft
from tests.engine.test_llm import hf_greedy
from tests.engine.test_speculative import BASE

KWARGS = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 128}
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory):
    """`drafts(family) -> (model_dir, layer_skip_draft_dir)`, built once per family."""
    built: dict[str, tuple[str, str]] = {}

    def get(family: str) -> tuple[str, str]:
        if family not in built:
            model_dir = tiny_model(family)
            out = tmp_path_factory.mktemp(f"{family}-draft")
            built[family] = (model_dir, build_layer_skip_draft(model_dir, out, 1))
        return built[family]

    return get


def check_pools(engine: LLMEngine) -> None:
    """Both pools whole and full, and no draft state left behind."""
    assert engine.draft is not None
    for pool in (engine.block_pool, engine.draft.pool):
        pool.check_integrity()
        assert pool.num_free_blocks == pool.num_blocks
    assert not engine.draft.seqs


def run(model_dir: str, draft_dir: str, prompts, params=GREEDY, num_tokens: int = 4, **kwargs):
    spec = SpeculativeConfig(method="draft", draft_model=draft_dir, num_tokens=num_tokens)
    with LLM(model_dir, speculative=spec, **{**KWARGS, **kwargs}) as llm:
        outputs = llm.generate(prompts, params)
        check_pools(llm.engine)
        speculator = llm.engine.scheduler.speculator
        assert speculator is not None
        return outputs, (speculator.num_proposed, speculator.num_accepted), llm.stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_equals_transformers(drafts, family: str) -> None:
    model_dir, draft_dir = drafts(family)
    expected = hf_greedy(model_dir, BASE, MAX_TOKENS)
    outputs, (proposed, accepted), _ = run(model_dir, draft_dir, BASE)
    assert [o.token_ids for o in outputs] == expected
    assert 0 < accepted < proposed, (proposed, accepted)
    assert sum(o.num_spec_proposed for o in outputs) == proposed
    assert sum(o.num_spec_accepted for o in outputs) == accepted
    # the target as its own draft: every proposal is what greedy decoding picks
    outputs, (proposed, accepted), _ = run(model_dir, model_dir, BASE)
    assert [o.token_ids for o in outputs] == expected
    assert 0 < accepted == proposed


def test_stops_and_max_tokens_inside_an_accepted_run(drafts) -> None:
    model_dir, _ = drafts("llama")
    expected = hf_greedy(model_dir, BASE, MAX_TOKENS)
    for prompt, reference in zip(BASE, expected, strict=True):
        stop = reference[9]
        cut = reference.index(stop) + 1
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=(stop,))
        (out,), _, _ = run(model_dir, model_dir, [prompt], params)
        assert (out.token_ids, out.finish_reason) == (reference[:cut], "stop")
    for max_tokens in (1, 2, 5):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        outputs, _, _ = run(model_dir, model_dir, BASE, params)
        assert [o.token_ids for o in outputs] == [e[:max_tokens] for e in expected]


def test_preemption_keeps_the_output_and_frees_the_draft(drafts) -> None:
    model_dir, draft_dir = drafts("llama")
    expected = hf_greedy(model_dir, BASE, MAX_TOKENS)
    outputs, (_, accepted), stats = run(model_dir, draft_dir, BASE, num_kv_blocks=14)
    assert stats.num_preemptions > 0 and accepted > 0
    assert [o.token_ids for o in outputs] == expected


def test_abort_mid_speculation_frees_both_pools(drafts) -> None:
    model_dir, draft_dir = drafts("llama")
    spec = SpeculativeConfig(method="draft", draft_model=model_dir, num_tokens=4)
    with LLM(model_dir, speculative=spec, **KWARGS) as llm:
        engine = llm.engine
        for i, prompt in enumerate(BASE):
            engine.add_request(f"r{i}", prompt, GREEDY)
        for _ in range(3):
            engine.step()
        assert engine.draft is not None and engine.draft.pool.num_used_blocks > 0
        for i in range(len(BASE)):
            assert engine.abort(f"r{i}")
        outs = engine.step()
        assert sorted(o.request_id for o in outs if o.finished) == [f"r{i}" for i in range(4)]
        check_pools(engine)


def test_a_layer_skip_draft_is_the_model_with_those_layers(tiny_model, tmp_path) -> None:
    """Layers kept out of order of the source's numbering are renumbered: the draft of layer 1
    alone equals transformers run on that folder, and differs from the first layer's draft."""
    model_dir = tiny_model("llama")
    second = build_layer_skip_draft(model_dir, tmp_path / "second", keep=[1])
    first = build_layer_skip_draft(model_dir, tmp_path / "first", 1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(second, **KWARGS) as llm:
        outputs = [o.token_ids for o in llm.generate(BASE, params)]
    assert outputs == hf_greedy(second, BASE, 8) != hf_greedy(first, BASE, 8)
    with pytest.raises(ValueError, match="keeps 1 to 1 of 2 layers"):
        build_layer_skip_draft(model_dir, tmp_path / "bad", keep=[0, 1])


def test_a_draft_with_another_vocabulary_is_refused(tiny_model) -> None:
    model_dir = tiny_model("llama")
    other = tiny_model("llama", vocab_size=100)
    spec = SpeculativeConfig(method="draft", draft_model=other)
    with pytest.raises(ValueError, match="must use the target's tokenizer"):
        LLM(model_dir, speculative=spec, **KWARGS)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_tensor_parallel_greedy_equals_transformers(drafts, family: str) -> None:
    """The draft is not sharded: it runs on the driver rank beside the TP=2 target."""
    model_dir, draft_dir = drafts(family)
    expected = hf_greedy(model_dir, BASE, MAX_TOKENS)
    outputs, (proposed, accepted), _ = run(model_dir, draft_dir, BASE, tensor_parallel_size=2)
    assert [o.token_ids for o in outputs] == expected
    assert 0 < accepted < proposed
