"""A model whose every layer slides gives back the KV blocks wholly before its window.

One block table serves all layers, so a block can go back only once no layer's window reaches
it: Mistral and Mixtral (every layer slides) release, Gemma 3 (a full layer) keeps everything.
The tiny Mistral slides over 32 tokens with blocks of 8; a context of 140 tokens would hold 18
blocks, but a decoding request keeps at most (32 - 1) // 8 + 2 = 5 of them, and its tokens
equal transformers' float64 greedy ones, with prefix hits and chunked prefill.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from tests.engine.test_llm import hf_greedy, make_prompts

BLOCK_SIZE = 8
WINDOW = 32  # the tiny Mistral's
MAX_NEW_TOKENS = 120
PROMPTS = make_prompts((20, 9, 27), seed=11)


def test_release_window_only_where_every_layer_slides(tiny_model) -> None:
    assert ModelConfig.from_model_dir(tiny_model("mistral")).release_window == WINDOW
    assert ModelConfig.from_model_dir(tiny_model("mixtral")).release_window == 24
    assert ModelConfig.from_model_dir(tiny_model("gemma3")).release_window is None
    assert ModelConfig.from_model_dir(tiny_model("llama")).release_window is None


def test_decoding_keeps_only_the_window_and_equals_transformers(tiny_model) -> None:
    model_dir = tiny_model("mistral")
    expected = hf_greedy(model_dir, PROMPTS[:1], MAX_NEW_TOKENS)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    kwargs = {"dtype": "float64", "block_size": BLOCK_SIZE, "num_kv_blocks": 64}
    peak = 0
    with LLM(model_dir, chunk_size=8, **kwargs) as llm:
        engine = llm.engine
        engine.add_request("a", PROMPTS[0], params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            stats = engine.stats
            peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
        assert engine.stats.num_free_blocks == 64
    assert tokens == expected[0]
    assert len(PROMPTS[0]) + MAX_NEW_TOKENS > 2 * WINDOW
    assert peak <= (WINDOW - 1) // BLOCK_SIZE + 2


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_released_blocks_with_prefix_hits_and_preemption(tiny_model, family: str) -> None:
    """Three requests would need 55 blocks without release; 19 hold their windows. A second
    pass hits the cached prompt blocks."""
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    kwargs = {"dtype": "float64", "block_size": BLOCK_SIZE, "num_kv_blocks": 19}
    with LLM(model_dir, chunk_size=16, max_num_batched_tokens=32, **kwargs) as llm:
        first = llm.generate(PROMPTS, params)
        second = llm.generate(PROMPTS, params)
        stats = llm.stats
        llm.engine.block_pool.check_integrity()
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert stats.num_prefix_hit_tokens > 0
    assert stats.num_free_blocks == 19
