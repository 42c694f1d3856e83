"""Greedy parity with Hugging Face transformers, for every model family, at TP=1.

Random-weight models have near-tied logits, so parity runs in float64 on both sides: then a
mismatch means a real bug, not rounding. Prompts of different lengths are batched together;
HF generates each prompt alone (no padding).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.executor import Executor
from tests.engine.greedy_loop import greedy_generate
from tests.tiny_models import FAMILIES, load_hf_model

PROMPT_LENS = (5, 12, 19, 26, 33, 40)
MAX_NEW_TOKENS = 64


def make_prompts(
    vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    hf = load_hf_model(model_dir, torch.float64)
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=None,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_logits(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """HF logits at every position of each full sequence (one forward each)."""
    hf = load_hf_model(model_dir, torch.float64)
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0] for seq in sequences]


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "fixed-shape"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model, family: str, fixed_shape: bool) -> None:
    """`fixed_shape`: pure-decode steps through engine/graphs.py's padded buffers, run eagerly
    (the path CUDA graphs replay on a GPU), with 6 sequences in a bucket of 8."""
    model_dir = tiny_model(family)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        block_size=8,
        num_kv_blocks=128,
        fixed_shape_decode=fixed_shape,
    )
    with Executor(config) as executor:
        prompts = make_prompts(executor.model_config.vocab_size)
        whole = greedy_generate(executor, prompts, MAX_NEW_TOKENS)
        chunked = greedy_generate(executor, prompts, MAX_NEW_TOKENS, chunk_size=7)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert all(len(e) == MAX_NEW_TOKENS for e in expected)
    assert len({t for e in expected for t in e}) > 20, "degenerate reference output"
    for i, prompt in enumerate(prompts):
        assert whole[i].token_ids == expected[i], f"prompt {i} (len {len(prompt)})"
        assert chunked[i].token_ids == expected[i], f"chunked prompt {i} (len {len(prompt)})"

    # Every sampled row (prefill and each decode step) equals HF's logits at that position.
    reference = hf_logits(model_dir, [p + e[:-1] for p, e in zip(prompts, expected, strict=True)])
    for i, prompt in enumerate(prompts):
        ours = torch.stack(whole[i].logits)  # [MAX_NEW_TOKENS, vocab]
        ours_chunked = torch.stack(chunked[i].logits)
        theirs = reference[i][len(prompt) - 1 :]
        assert ours.dtype == torch.float64
        assert (ours - theirs).abs().max().item() < 1e-9
        assert (ours_chunked - theirs).abs().max().item() < 1e-9


def test_float32_logits_close_to_transformers(tiny_model) -> None:
    model_dir = tiny_model("llama")
    config = EngineConfig(model_dir=model_dir, dtype="float32", block_size=16, num_kv_blocks=32)
    with Executor(config) as executor:
        prompts = make_prompts(executor.model_config.vocab_size, lens=(9, 30))
        results = greedy_generate(executor, prompts, 4)
    hf = load_hf_model(model_dir, torch.float32)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.logits[0].dtype == torch.float32
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, -1]
        assert (result.logits[0] - theirs).abs().max().item() < 1e-4
