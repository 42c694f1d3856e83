"""Speculative decoding (prompt lookup) offline through engine.LLM: greedy output token-identical
to transformers in float64 and to non-speculative decoding, with stops, max_tokens, preemption,
aborts and the prefix cache; every block back in the pool, freed once.

Prompts repeat themselves (a random prompt, the model's own continuation of it, the prompt
again), so the n-gram proposer finds matches; the random weights accept some proposals and
reject others, so both sides of verification run.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.speculative import ngram
from engine.speculative.config import SpeculativeConfig
from engine.speculative.state import SpecState
from tests.engine.test_llm import hf_greedy, make_prompts

KWARGS = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 128}
SPEC = SpeculativeConfig(num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
BASE = make_prompts((5, 12, 19, 26), seed=5)


def copy_prompts(model_dir: str) -> list[list[int]]:
    """prompt + the model's greedy continuation of it + prompt: a continuation to copy."""
    with LLM(model_dir, **KWARGS) as llm:
        first = [o.token_ids for o in llm.generate(BASE, SamplingParams(max_tokens=24))]
    return [p + o + p for p, o in zip(BASE, first, strict=True)]


def run(model_dir: str, prompts, params=GREEDY, spec=SPEC, **kwargs):
    """Outputs, the speculator's (proposed, accepted) and the pool, checked whole."""
    with LLM(model_dir, speculative=spec, **{**KWARGS, **kwargs}) as llm:
        outputs = llm.generate(prompts, params)
        pool = llm.engine.block_pool
        pool.check_integrity()
        assert pool.num_free_blocks == pool.num_blocks
        speculator = llm.engine.scheduler.speculator
        counts = (speculator.num_proposed, speculator.num_accepted) if speculator else (0, 0)
        return outputs, counts, llm.stats


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 1, 3) == [7, 8, 1]
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3], 5, 1, 3) == [9, 1, 2, 3]
    assert ngram.propose([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert ngram.propose([4, 4], 3, 2, 3) == []  # too short for a 2-gram and a follower
    # the longest n wins over a later shorter match: [2, 3] last followed by 5, [3] by 6
    assert ngram.propose([2, 3, 5, 0, 3, 6, 2, 3], 1, 1, 2) == [5]
    # ids that share bytes across an int boundary do not fake a match
    assert ngram.propose([256, 1, 0, 1], 2, 1, 1) == [0, 1]
    assert ngram.propose([1 << 20, 3, 1 << 20], 1, 1, 1) == [3]


def test_adaptive_length_shrinks_pauses_and_recovers() -> None:
    state = SpecState(4)
    state.observe(4, 4)
    assert state.num_tokens == 4
    state.observe(4, 1)
    assert state.num_tokens == 2
    state.observe(2, 0)
    state.observe(1, 0)
    assert state.paused_steps == 2 and [state.wants_proposal() for _ in range(3)] == [
        False,
        False,
        True,
    ]
    state.observe(1, 1)
    assert state.num_tokens == 2 and state.misses == 0
    assert state.acceptance_rate == pytest.approx(6 / 12)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_equals_transformers_and_plain_decoding(tiny_model, family: str) -> None:
    model_dir = tiny_model(family)
    prompts = copy_prompts(model_dir)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    outputs, (proposed, accepted), _ = run(model_dir, prompts)
    plain, _, _ = run(model_dir, prompts, spec=None)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain] == expected
    assert 0 < accepted < proposed, (proposed, accepted)
    # per request, in the outputs: the counts add up to the engine's
    assert sum(o.num_spec_proposed for o in outputs) == proposed
    assert sum(o.num_spec_accepted for o in outputs) == accepted
    assert {(o.num_spec_proposed, o.num_spec_accepted) for o in plain} == {(0, 0)}


def test_requests_with_and_without_speculation_share_steps(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = copy_prompts(model_dir)
    off = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, speculative=False)
    params = [GREEDY, off, GREEDY, off]
    outputs, (proposed, _), _ = run(model_dir, prompts, params)
    plain, _, _ = run(model_dir, prompts, spec=None)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert proposed > 0


def test_stop_tokens_and_max_tokens_end_inside_an_accepted_run(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = copy_prompts(model_dir)
    plain, _, _ = run(model_dir, prompts, spec=None)
    # stop at the 10th token of each plain output: the speculative run must end there too
    for prompt, reference in zip(prompts, plain, strict=True):
        stop = reference.token_ids[9]
        cut = reference.token_ids.index(stop) + 1
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=(stop,))
        (out,), _, _ = run(model_dir, [prompt], params)
        assert (out.token_ids, out.finish_reason) == (reference.token_ids[:cut], "stop")
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        outputs, _, _ = run(model_dir, prompts, params)
        assert [o.token_ids for o in outputs] == [p.token_ids[:max_tokens] for p in plain]
        assert {o.finish_reason for o in outputs} == {"length"}


def test_preemption_and_prefix_cache_keep_the_output(tiny_model) -> None:
    """A pool too small for the batch preempts mid-speculation; a second pass reuses cached
    blocks of the first pass's outputs, which must hold only accepted tokens' KV."""
    model_dir = tiny_model("llama")
    prompts = copy_prompts(model_dir)
    plain, _, _ = run(model_dir, prompts, spec=None)
    outputs, (_, accepted), stats = run(model_dir, prompts, num_kv_blocks=24)
    assert stats.num_preemptions > 0 and accepted > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    # the second prompts extend the first outputs: their blocks (spec-written) are hit
    second = [p + o.token_ids[:30] for p, o in zip(prompts, plain, strict=True)]
    with LLM(model_dir, speculative=SPEC, **KWARGS) as llm:
        llm.generate(prompts, GREEDY)
        hits = llm.generate(second, GREEDY)
        assert sum(o.num_cached_tokens for o in hits) > 0
        llm.engine.block_pool.check_integrity()
    reference, _, _ = run(model_dir, second, spec=None, enable_prefix_caching=False)
    assert [o.token_ids for o in hits] == [o.token_ids for o in reference]


def test_abort_mid_speculation_frees_every_block(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = copy_prompts(model_dir)
    with LLM(model_dir, speculative=SPEC, **KWARGS) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
        proposed = 0
        for _ in range(6):
            engine.step()
            proposed = engine.scheduler.speculator.num_proposed
        assert proposed > 0
        for i in range(len(prompts)):
            assert engine.abort(f"r{i}")
        outs = engine.step()
        assert sorted(o.request_id for o in outs if o.finished) == [f"r{i}" for i in range(4)]
        engine.block_pool.check_integrity()
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tensor_parallel_greedy_equals_transformers(tiny_model, family: str) -> None:
    model_dir = tiny_model(family)
    prompts = copy_prompts(model_dir)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    outputs, (proposed, accepted), _ = run(model_dir, prompts, tensor_parallel_size=2)
    assert [o.token_ids for o in outputs] == expected
    assert 0 < accepted < proposed


def test_bad_speculative_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'draft' needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="only for method 'draft'"):
        SpeculativeConfig(draft_model="some/model")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
