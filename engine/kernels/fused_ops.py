"""Fused small ops in Triton: RMSNorm with its residual add, SiLU x mul, and rotary in place.

Why Triton and not a kernel library: liger-kernel's RMSNorm and SwiGLU are training kernels
(each saves what its backward needs and has no residual-add variant), and its rotary takes
[batch, heads, seq, head_dim] tensors, not the packed [num_tokens, heads, head_dim] rows with a
position per token that a serving step has. Three small kernels written against our own layouts
(vLLM and nano-vllm have the same three) cost less than adapting them.

Each op matches the torch ops it replaces in engine/models/llama.py: math in float32 (float64
for a float64 model, but the norm's statistics, which transformers takes in float32 too),
rounded to the model dtype where torch rounds (the residual sum; the normalised row before the
weight; the SiLU before the multiply). One program per token row.

- add_rms_norm: residual_out = x + residual (in the model dtype, as `hidden + attn_out` is),
  out = RMSNorm(residual_out); residual None: out = RMSNorm(x), residual_out = x.
- silu_and_mul: [num_tokens, 2 * inter] -> silu(gate) * up [num_tokens, inter].
- rotary_: rotates the first `num_heads` heads of each row of `qkv` [num_tokens, *] in place by
  the cos/sin tables [max_positions, head_dim // 2] at each token's position ("rotate half").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    hidden_size,
    HAS_RESIDUAL: tl.constexpr,
    FP32: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Arithmetic in `wide`, rounded where torch rounds (bfloat16 arithmetic itself is wrong in
    # Triton's interpreter, and on the GPU it computes in float32 and rounds the same way).
    wide = tl.float64 if FP64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * hidden_size + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden_size + cols, mask=mask, other=0.0)
        x = (x.to(wide) + residual.to(wide)).to(x.dtype)  # torch's `hidden + out`
        tl.store(residual_out_ptr + row * hidden_size + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if FP32:
        normed = xf * rstd * weight
    else:  # transformers: normalise in float32, cast back, then multiply by the weight
        normed = (xf * rstd).to(x.dtype).to(wide) * weight.to(wide)
    tl.store(out_ptr + row * hidden_size + cols, normed.to(x.dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [num_tokens, hidden] contiguous."""
    x = x.contiguous()
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            out,
            residual_out,
            x,
            residual.contiguous() if residual is not None else x,
            weight,
            eps,
            hidden_size,
            HAS_RESIDUAL=residual is not None,
            FP32=x.dtype == torch.float32,
            FP64=x.dtype == torch.float64,
            BLOCK=triton.next_power_of_2(hidden_size),
        )
    return out, residual_out


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, inter_size, BLOCK: tl.constexpr, FP64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * 2 * inter_size + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * inter_size + inter_size + cols, mask=mask, other=0.0)
    wide = tl.float64 if FP64 else tl.float32
    gf = gate.to(wide)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
    out = (silu.to(wide) * up.to(wide)).to(gate.dtype)  # torch's `silu(gate).mul_(up)`
    tl.store(out_ptr + row * inter_size + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] (gate then up, contiguous) -> silu(gate) * up."""
    x = x.contiguous()
    num_tokens, width = x.shape
    inter_size = width // 2
    out = torch.empty(num_tokens, inter_size, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter_size))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, block))](
            out, x, inter_size, BLOCK=block, FP64=x.dtype == torch.float64
        )
    return out


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP64: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < half
    acc_dtype = tl.float64 if FP64 else tl.float32
    cos = tl.load(cos_ptr + pos * half + j, mask=j_mask, other=0.0).to(acc_dtype)
    sin = tl.load(sin_ptr + pos * half + j, mask=j_mask, other=0.0).to(acc_dtype)
    mask = (h[:, None] < num_heads) & j_mask[None, :]
    first = qkv_ptr + token * stride_t + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    x1f = x1.to(acc_dtype)
    x2f = x2.to(acc_dtype)
    tl.store(first, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


def rotary_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    """Rotate heads 0..num_heads-1 of each row of `qkv` [num_tokens, >= num_heads * head_dim]
    (heads packed, each row contiguous) in place; cos, sin [max_positions, head_dim // 2]."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            qkv,
            positions,
            cos,
            sin,
            qkv.stride(0),
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            FP64=qkv.dtype == torch.float64,
        )
