"""Tensor parallelism over NCCL: TP=2 on two GPUs gives transformers' greedy tokens.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so this needs two devices; it skips
on one-GPU machines as well as on CPU machines.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.executor import Executor
from tests.engine.greedy_loop import greedy_generate
from tests.engine.test_model_parity import hf_greedy, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (NCCL takes one GPU per rank)",
    ),
]


@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("mistral", {"vocab_size": 509})])
def test_nccl_tp2_float64_matches_transformers(tiny_model, family: str, overrides: dict) -> None:
    model_dir = tiny_model(family, **overrides)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        device="cuda",
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=64,
    )
    with Executor(config) as executor:
        prompts = make_prompts(executor.model_config.vocab_size, (5, 14, 27, 40))
        results = greedy_generate(executor, prompts, 48, chunk_size=9)
    expected = hf_greedy(model_dir, prompts, 48)
    assert [r.token_ids for r in results] == expected
