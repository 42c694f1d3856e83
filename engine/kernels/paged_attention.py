"""Paged decode attention and the KV write, in Triton, over the head-major cache in place.

Cache: key_cache, value_cache [num_kv_heads, num_blocks, block_size, head_dim] (a layer's slice
of engine/kv_cache.py; head_dim contiguous). A token at position p of a sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`.

`write_kv`: one program per (token, KV head) stores the token's key and value row at its slot
(`block_id * block_size + offset`). A slot below 0 is a padding token of a fixed-shape step and
is skipped, as vLLM's PAD_SLOT_ID is.

`paged_decode_attention`: one program per (sequence, KV head) runs the g = num_heads //
num_kv_heads query heads that share the KV head together, so each key and value row is read
once per KV head. It walks the sequence's positions in tiles of BLOCK_N, looking each position's
block up in the block table (any block size works, and nothing is padded to the longest
sequence), with an online softmax in float32 (float64 for float64 models). Scores and the weighted sum are
tl.dot products (tensor cores; the query group padded to 16 rows), but for float64, which has
none and takes a broadcast product instead. A sequence of context
length 0 is padding: its output rows are zeros. A sliding window W reads only positions
p > context_len - 1 - W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_co,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)  # head * stride_ch passes 2**31 in a large cache
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # the slot broadcast to a vector first: the interpreter rejects a scalar & vector mask
    mask = (d < HEAD_DIM) & (tl.zeros([BLOCK_D], tl.int64) + slot >= 0)
    block = tl.maximum(slot, 0) // block_size
    offset = tl.maximum(slot, 0) % block_size
    dst = head * stride_ch + block * stride_cb + offset * stride_co + d
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] (head_dim contiguous) into their slots."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    sliding_window,  # 0: full attention
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_co,
    stride_bt,
    block_size,
    group_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < group_size
    d_mask = d < HEAD_DIM
    heads = kv_head * group_size + g
    q_raw = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q_raw.to(acc_dtype)
    m = tl.full([BLOCK_G], float("-inf"), acc_dtype)
    denom = tl.zeros([BLOCK_G], acc_dtype)
    acc = tl.zeros([BLOCK_G, BLOCK_D], acc_dtype)
    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    cache_base = kv_head.to(tl.int64) * stride_ch
    for start in range(first, context_len, BLOCK_N):
        pos = start + n
        valid = pos < context_len
        block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid)
        row = cache_base + block_id.to(tl.int64) * stride_cb + (pos % block_size) * stride_co
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:  # tensor cores: [G, D] x [D, N], float32 accumulation
            if IEEE:
                scores = tl.dot(q_raw, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q_raw, tl.trans(k))
        else:  # float64: no tensor-core dot; a broadcast product, fine for tests
            scores = tl.sum(q[:, None, :] * k.to(acc_dtype)[None, :, :], axis=2)
        scores = scores * scale  # [G, N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(acc_dtype)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim]; block_tables [num_seqs, >= the blocks each context
    needs] (any int dtype); context_lens [num_seqs] including the new token. Returns (or fills
    `out`) [num_seqs, num_heads, head_dim]. `block_n`: keys per tile, 64 by default; 32 for
    float32 at head dims above 64, which spill registers on sm_80 at 64 (255 registers, no spill
    at 32: tests/engine/test_triton_compile.py)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    # tl.dot (tensor cores) needs every dimension >= 16, and has no float64: float64 models
    # take a broadcast product, which is exact enough for parity and slow, and only for tests.
    use_dot = q.dtype != torch.float64
    minimum = 16 if use_dot else 1
    block_d = max(triton.next_power_of_2(head_dim), minimum)
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 and block_d > 64 else 64
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        key_cache.shape[2],
        group_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=max(triton.next_power_of_2(group_size), minimum),
        BLOCK_N=max(block_n, minimum),
        ACC_FP64=not use_dot,
        USE_DOT=use_dot,
        IEEE=q.dtype == torch.float32,
    )
    return out
