"""Tensor parallelism with real processes over gloo: TP=2 gives TP=1's (and HF's) greedy tokens.

Covers KV heads split across ranks (llama: 2 KV heads), KV heads replicated when TP exceeds them
(mistral: 1 KV head) together with a vocab that does not split evenly, sharded q/k/v biases with
tied embeddings (qwen2), the newer families (Qwen3, Phi-3's fused checkpoint tensors,
Qwen3-MoE's and Mixtral's experts, Gemma 3), and a dead rank turning into an error instead of a hang.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.executor import Executor
from engine.kv_cache import local_kv_heads
from tests.engine.greedy_loop import greedy_generate
from tests.engine.test_model_parity import hf_greedy, make_prompts

pytestmark = pytest.mark.slow

PROMPT_LENS = (5, 14, 27, 40)
MAX_NEW_TOKENS = 64


def run(model_dir: str, tp_size: int, chunk_size: int | None = None):
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        tensor_parallel_size=tp_size,
        block_size=8,
        num_kv_blocks=64,
    )
    with Executor(config) as executor:
        prompts = make_prompts(executor.model_config.vocab_size, PROMPT_LENS)
        results = greedy_generate(executor, prompts, MAX_NEW_TOKENS, chunk_size=chunk_size)
        kv_data = executor.kv_cache.data.clone()
    return prompts, results, kv_data


@pytest.mark.parametrize(
    ("family", "overrides", "num_local_kv_heads"),
    [
        ("llama", {}, 1),  # 2 KV heads split 1 + 1
        ("mistral", {"vocab_size": 509}, 1),  # 1 KV head replicated; vocab padded to 510
        ("qwen2", {}, 1),  # q/k/v biases sharded, tied embeddings
        ("qwen3", {}, 1),  # per-head q/k norms replicated
        ("phi3", {}, 1),  # fused checkpoint q/k/v and gate/up, each part split
        ("qwen3_moe", {}, 1),  # every expert's intermediate dim split, router replicated
        ("mixtral", {}, 1),  # the same for Mixtral's checkpoint names, with a sliding window
        ("gemma3", {}, 1),  # sliding and full layers, tied embeddings, soft-capped logits
    ],
)
def test_tp2_matches_tp1_and_transformers(
    tiny_model, family, overrides, num_local_kv_heads
) -> None:
    model_dir = tiny_model(family, **overrides)
    prompts, tp1, tp1_kv = run(model_dir, tp_size=1)
    _, tp2, tp2_kv = run(model_dir, tp_size=2, chunk_size=9)
    assert tp2_kv.shape[2] == num_local_kv_heads  # [layers, 2, heads, blocks, block, head_dim]
    # Rank 0 holds exactly the KV heads engine.kv_cache.local_kv_heads names, in the same blocks.
    heads = list(local_kv_heads(tp1_kv.shape[2], 2, 0))
    assert (tp2_kv - tp1_kv[:, :, heads]).abs().max().item() < 1e-9
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    for i in range(len(prompts)):
        assert tp1[i].token_ids == expected[i]
        assert tp2[i].token_ids == expected[i], f"prompt {i}"
        diff = (torch.stack(tp1[i].logits) - torch.stack(tp2[i].logits)).abs().max().item()
        assert diff < 1e-9


def test_dead_rank_raises_instead_of_hanging(tiny_model) -> None:
    config = EngineConfig(
        model_dir=tiny_model("llama"), tensor_parallel_size=2, block_size=8, num_kv_blocks=16
    )
    executor = Executor(config, timeout_s=30)
    try:
        prompts = make_prompts(executor.model_config.vocab_size, (6,))
        assert len(greedy_generate(executor, prompts, 2)[0].token_ids) == 2
        (pid,) = executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="TP rank 1"):
            greedy_generate(executor, prompts, 2)
        assert time.monotonic() - started < 10
    finally:
        executor.shutdown()
        executor.shutdown()  # idempotent
    assert executor.worker_pids == []


def test_shutdown_stops_workers(tiny_model) -> None:
    config = EngineConfig(
        model_dir=tiny_model("llama"), tensor_parallel_size=2, block_size=8, num_kv_blocks=16
    )
    with Executor(config) as executor:
        (pid,) = executor.worker_pids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.execute(None)  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
