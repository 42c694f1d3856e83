"""The fused Triton ops (engine/kernels/fused_ops.py) against the torch ops they replace, and
the fused Llama forward (engine/models/fused_llama.py) against transformers in float64.

On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.config import EngineConfig  # noqa: E402
from engine.executor import Executor  # noqa: E402
from engine.kernels.fused_ops import add_rms_norm, rotary_, silu_and_mul  # noqa: E402
from engine.models import fused_llama  # noqa: E402
from engine.models.llama import RMSNorm  # noqa: E402
from engine.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.engine.greedy_loop import greedy_generate  # noqa: E402
from tests.engine.test_model_parity import hf_greedy, make_prompts  # noqa: E402

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_add_rms_norm(dtype: torch.dtype) -> None:
    hidden = 48  # not a power of two: the kernel masks its tail
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(hidden, generator=GEN))
    x = torch.randn(7, hidden, generator=GEN).to(dtype)
    residual = torch.randn(7, hidden, generator=GEN).to(dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    out, summed = add_rms_norm(x, residual, norm.weight, norm.eps)
    if dtype == torch.bfloat16:  # the interpreter rounds float32 to bfloat16 toward zero
        torch.testing.assert_close(summed, x + residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, norm(x + residual), **tol)
    out, same = add_rms_norm(x, None, norm.weight, norm.eps)
    assert same is x or torch.equal(same, x)
    torch.testing.assert_close(out, norm(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 40, generator=GEN).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, **tol)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 1), (3, 3)])
def test_rotary_in_place(heads: int, kv_heads: int) -> None:
    head_dim = 16
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0}, torch.float32)
    qkv = torch.randn(9, (heads + 2 * kv_heads) * head_dim, generator=GEN)
    positions = torch.tensor([0, 3, 63, 5, 5, 17, 1, 40, 2])
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(9, heads + kv_heads, head_dim)
    expected = apply_rotary(qk, *rope.cos_sin(positions))
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rotary_(qkv, positions, rope.cos, rope.sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_fused_forward_matches_transformers_in_float64(tiny_model, family: str) -> None:
    """Greedy tokens equal transformers', with fixed-shape decode steps and chunked prefill."""
    model_dir = tiny_model(family)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        block_size=8,
        num_kv_blocks=64,
        fused_ops=True,
        fixed_shape_decode=True,
    )
    with Executor(config) as executor:
        assert executor._runner.model.fused_ops
        prompts = make_prompts(executor.model_config.vocab_size, lens=(5, 19, 26))
        ours = greedy_generate(executor, prompts, 24, chunk_size=7)
    expected = hf_greedy(model_dir, prompts, 24)
    assert [r.token_ids for r in ours] == expected


@pytest.mark.slow  # about 20 s each: every kernel launch is interpreted
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_graphed_gpu_path_run_eagerly_matches_transformers(tiny_model, family: str) -> None:
    """What a CUDA graph replays, run eagerly on CPU: the fixed-shape buffers with padding rows,
    the Triton KV write and decode attention, and the fused ops, all at once (Qwen2: a sliding
    window in the tiny model)."""
    model_dir = tiny_model(family)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        block_size=8,
        num_kv_blocks=64,
        attention_backend="triton",
        fused_ops=True,
        fixed_shape_decode=True,
    )
    with Executor(config) as executor:
        runner = executor._runner
        assert runner.backend.name == "triton" and runner.model.fused_ops
        prompts = make_prompts(executor.model_config.vocab_size, lens=(5, 19, 26))
        ours = greedy_generate(executor, prompts, 24)
    assert [r.token_ids for r in ours] == hf_greedy(model_dir, prompts, 24)


def test_gemma_keeps_the_torch_forward(tiny_model) -> None:
    config = EngineConfig(model_dir=tiny_model("gemma3"), num_kv_blocks=8, fused_ops=True)
    with Executor(config) as executor:
        assert not fused_llama.supports(executor._runner.model)
        assert not executor._runner.model.fused_ops
