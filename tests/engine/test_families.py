"""The newer families offline: chunked prefill, prefix hits and preemption together give
transformers' float64 greedy tokens; a Qwen3-MoE block's grouped-matmul path equals its loop.

One engine per family runs prompts that share a 35-token prefix, in chunks of 16 under a
budget of 32, from a pool of 24 blocks of 8 that cannot hold them all (they grow to 84-100
tokens, 4 shared blocks and 7-9 own blocks each), so it preempts; a second pass of the same prompts starts from cached prefixes. Every
context passes Gemma 3's sliding window (16 tokens in the tiny model).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.models.moe import SparseMoeBlock, grouped_mm_available
from tests.engine.test_llm import hf_greedy, make_prompts

NEW_FAMILIES = ("qwen3", "phi3", "qwen3_moe", "mixtral", "gemma3")
MAX_NEW_TOKENS = 48
SHARED = make_prompts((35,), seed=2)[0]
PROMPTS = [SHARED + tail for tail in make_prompts((5, 11, 17, 1), seed=3)]


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_chunked_prefix_hits_and_preemption_equal_transformers(
    tiny_model, family: str, fixed_shape: bool
) -> None:
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    assert len({t for e in expected for t in e}) > 20, "degenerate reference output"
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    # Mixtral slides on every layer, so decoding gives blocks before its window back: a pool
    # of 24 would hold every window at once; 14 still fits the longest request whole
    num_blocks = 14 if family == "mixtral" else 24
    kwargs = {"dtype": "float64", "block_size": 8, "num_kv_blocks": num_blocks}
    kwargs["fixed_shape_decode"] = fixed_shape  # engine/graphs.py's padded decode buffers
    with LLM(model_dir, chunk_size=16, max_num_batched_tokens=32, **kwargs) as llm:
        first = llm.generate(PROMPTS, params)
        second = llm.generate(PROMPTS, params)
        stats = llm.stats
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0
    assert any(o.num_cached_tokens >= 32 for o in second)
    assert stats.num_free_blocks == num_blocks


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="no grouped_mm")
def test_moe_grouped_matmul_equals_the_expert_loop(tiny_model) -> None:
    config = ModelConfig.from_model_dir(tiny_model("qwen3_moe"))
    torch.manual_seed(0)
    with torch.device("cpu"):
        block = SparseMoeBlock(config).float()
    for param in (block.gate.weight, block.w13, block.w2):
        param.data.normal_(0.0, 0.2)
    x = torch.randn(37, config.hidden_size)
    assert grouped_mm_available(x)
    grouped = block(x)
    looped = block.double()(x.double())  # float64 takes the loop
    assert not grouped_mm_available(x.double())
    assert (grouped.double() - looped).abs().max().item() < 1e-4
