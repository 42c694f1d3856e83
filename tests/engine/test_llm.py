"""LLM / LLMEngine end to end on tiny random-weight models: greedy parity with transformers for
every family, and chunked prefill, prefix caching and preemption each giving identical outputs.

Parity runs in float64 on both sides: random weights give near-tied logits, and float64 makes a
mismatch mean a real bug rather than rounding.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.outputs import StepOutput
from tests.tiny_models import FAMILIES, load_hf_model

MAX_NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
ENGINE_KWARGS = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 128}


def make_prompts(lens: tuple[int, ...], seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), EOS disabled."""
    hf = load_hf_model(model_dir, torch.float64)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


PROMPTS = make_prompts((5, 12, 19, 26, 33, 40))
LONG_PROMPTS = make_prompts((70, 100, 45, 17), seed=1)


@pytest.fixture(scope="module")
def llama_reference(tiny_model) -> dict[str, list[list[int]]]:
    model_dir = tiny_model("llama")
    return {
        "short": hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS),
        "long": hf_greedy(model_dir, LONG_PROMPTS, MAX_NEW_TOKENS),
    }


def _token_ids(outputs) -> list[list[int]]:
    return [out.token_ids for out in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_transformers(tiny_model, family: str) -> None:
    model_dir = tiny_model(family)
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    assert len({t for e in expected for t in e}) > 20, "degenerate reference output"
    assert _token_ids(outputs) == expected
    assert [(o.finish_reason, o.prompt_token_ids) for o in outputs] == [
        ("length", p) for p in PROMPTS
    ]


def test_chunked_prefill_equals_unchunked_and_transformers(tiny_model, llama_reference) -> None:
    model_dir = tiny_model("llama")
    with LLM(model_dir, chunk_size=16, max_num_batched_tokens=32, **ENGINE_KWARGS) as llm:
        chunked = llm.generate(LONG_PROMPTS, GREEDY)
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        whole = llm.generate(LONG_PROMPTS, GREEDY)
    assert _token_ids(chunked) == _token_ids(whole) == llama_reference["long"]


def test_prefix_cache_hit_equals_miss_and_counts_skipped_tokens(tiny_model) -> None:
    model_dir = tiny_model("llama")
    shared = make_prompts((35,), seed=2)[0]  # 4 full blocks of 8, plus 3 tokens
    prompts = [shared + tail for tail in make_prompts((6, 11, 1), seed=3)]
    with LLM(model_dir, enable_prefix_caching=False, **ENGINE_KWARGS) as llm:
        misses = llm.generate(prompts, GREEDY)
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        first = llm.generate(prompts[:1], GREEDY)
        hits = llm.generate(prompts[1:], GREEDY)
        stats = llm.stats
    assert _token_ids(first + hits) == _token_ids(misses)
    assert [o.num_cached_tokens for o in first + hits] == [0, 32, 32]
    assert [o.num_cached_tokens for o in misses] == [0, 0, 0]
    assert stats.num_prefix_hit_tokens == 64
    assert stats.num_prefix_queried_tokens == sum(len(p) for p in prompts)


def test_small_pool_preempts_and_outputs_stay_identical(tiny_model, llama_reference) -> None:
    # The 6 sequences grow to 69..104 tokens, 9..13 blocks of 8 each: 40 blocks hold about half.
    kwargs = {**ENGINE_KWARGS, "num_kv_blocks": 40}
    with LLM(tiny_model("llama"), **kwargs) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats
    assert stats.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == stats.num_preemptions
    assert _token_ids(outputs) == llama_reference["short"]
    assert stats.num_free_blocks == 40


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_model) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    prompt = PROMPTS[2]
    with LLM(tiny_model("llama"), **ENGINE_KWARGS) as llm:
        alone = llm.generate([prompt], params)[0].token_ids
        others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(5)]
        batch = llm.generate(
            PROMPTS[:2] + [prompt] + PROMPTS[3:], others[:2] + [params] + others[2:]
        )
        other_seed = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.9, seed=9))
        unseeded = llm.generate([prompt, prompt], SamplingParams(max_tokens=24, temperature=0.9))
    greedy = hf_greedy(tiny_model("llama"), [prompt], 24)[0]
    assert batch[2].token_ids == alone
    assert alone != greedy  # it did sample
    assert other_seed[0].token_ids != alone
    assert unseeded[0].token_ids != unseeded[1].token_ids  # each request drew its own seed


def test_seeded_sampling_survives_preemption(tiny_model) -> None:
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s) for s in range(6)]
    with LLM(tiny_model("llama"), **ENGINE_KWARGS) as llm:
        roomy = llm.generate(PROMPTS, params)
    with LLM(tiny_model("llama"), **{**ENGINE_KWARGS, "num_kv_blocks": 30}) as llm:
        tight = llm.generate(PROMPTS, params)
        assert llm.stats.num_preemptions > 0
    assert _token_ids(tight) == _token_ids(roomy)


def test_eos_and_stop_tokens_end_generation(tiny_model, llama_reference) -> None:
    third = llama_reference["short"][0][2]
    stop_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, stop_token_ids=(third,))
    with LLM(tiny_model("llama"), **ENGINE_KWARGS) as llm:
        stopped = llm.generate(PROMPTS[:1], stop_params)[0]
    assert (stopped.token_ids, stopped.finish_reason) == (llama_reference["short"][0][:3], "stop")
    # The same weights with that token as the model's EOS (generation_config's eos_token_id).
    with LLM(tiny_model("llama", eos_token_id=third), **ENGINE_KWARGS) as llm:
        eos = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_NEW_TOKENS))[0]
        ignored = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert (eos.token_ids, eos.finish_reason) == (llama_reference["short"][0][:3], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (llama_reference["short"][0], "length")


def test_max_model_len_and_errors(tiny_model) -> None:
    with LLM(tiny_model("llama"), max_model_len=20, **ENGINE_KWARGS) as llm:
        capped = llm.generate([PROMPTS[1]], GREEDY)[0]  # 12 prompt tokens
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([PROMPTS[3]], GREEDY)  # 26 tokens > 20
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([[1, 2, 100_000]], GREEDY)
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(PROMPTS[:2], [GREEDY])
        assert not llm.engine.has_unfinished()
    assert (len(capped.token_ids), capped.finish_reason) == (8, "length")
    with LLM(tiny_model("llama"), **{**ENGINE_KWARGS, "num_kv_blocks": 4}) as llm:
        too_big = llm.generate([PROMPTS[0]], GREEDY)[0]  # 69 tokens need 9 blocks
    assert (too_big.token_ids, too_big.finish_reason) == ([], "error")
    assert "4 blocks" in (too_big.error or "")


def test_engine_joins_new_requests_mid_decode_and_abort_frees_blocks(
    tiny_model, llama_reference
) -> None:
    engine = LLMEngine(EngineConfig(model_dir=tiny_model("llama"), **ENGINE_KWARGS))
    try:
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.add_request("doomed", PROMPTS[5], GREEDY)
        tokens: dict[str, list[int]] = {"a": [], "b": [], "doomed": []}
        for _ in range(5):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        engine.add_request("b", PROMPTS[1], GREEDY)  # joins while a decodes
        assert engine.abort("doomed")
        assert engine.stats.num_running == 1
        finished: list[StepOutput] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                finished += [out] if out.finished else []
        assert [(o.request_id, o.finish_reason) for o in finished] == [
            ("doomed", "abort"),
            ("a", "length"),
            ("b", "length"),
        ]
        assert tokens["a"] == llama_reference["short"][0]
        assert tokens["b"] == llama_reference["short"][1]
        assert tokens["doomed"] == llama_reference["short"][5][:5]
        assert engine.stats.num_free_blocks == 128
        engine.block_pool.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny_model, llama_reference) -> None:
    with LLM(tiny_model("llama"), tensor_parallel_size=2, **ENGINE_KWARGS) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    assert _token_ids(outputs) == llama_reference["short"]
