"""The Triton KV write and paged decode attention against the torch back end.

On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
Cases: odd context lengths, GQA ratios 1, 2, 3 and 4, block sizes 1, 5, 8 and 16, sequences
sharing prefix blocks (prefix hits), sliding windows, padding rows of a fixed-shape step, and a
mixed step whose prefill chunks follow cached positions.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention import TorchAttentionBackend, build_attention_metadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.paged_attention import paged_decode_attention, write_kv  # noqa: E402

HEAD_DIM = 16


def _tables(lens: list[int], block_size: int, num_blocks: int, shared: int, seed: int):
    """Shuffled block tables; every table starts with the same `shared` blocks (a prefix hit)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    prefix, rest = ids[:shared], ids[shared:]
    tables = []
    for n in lens:
        need = -(-n // block_size) - shared
        tables.append(prefix + rest[:need])
        rest = rest[need:]
    return tables


def _case(lens, new_tokens, num_heads, num_kv_heads, block_size, shared=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    shape = (num_kv_heads, num_blocks, block_size, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    tables = _tables(lens, block_size, num_blocks, shared, seed)
    starts = [n - t for n, t in zip(lens, new_tokens, strict=True)]
    num_decodes = sum(1 for t in new_tokens if t == 1)
    metadata, _ = build_attention_metadata(
        starts, new_tokens, tables, num_decodes, block_size, torch.device("cpu")
    )
    num_tokens = sum(new_tokens)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, HEAD_DIM, generator=gen)
    q = qkv[:, :num_heads]
    k = qkv[:, num_heads : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]
    return q, k, v, key_cache, value_cache, metadata


def _both(backend_args, sliding_window=None):
    q, k, v, key_cache, value_cache, metadata = backend_args
    caches = (key_cache.clone(), value_cache.clone())
    theirs = TorchAttentionBackend().forward(q, k, v, *caches, metadata, 0.25, sliding_window)
    metadata.mask_cache.clear()
    ours = TritonAttentionBackend().forward(
        q, k, v, key_cache, value_cache, metadata, 0.25, sliding_window
    )
    assert torch.equal(key_cache, caches[0]) and torch.equal(value_cache, caches[1])
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size"),
    [(4, 4, 8), (4, 2, 16), (6, 2, 5), (8, 2, 1), (4, 1, 8)],
)
def test_decode_matches_torch(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    lens = [1, 7, 33, 70, 129]
    case = _case(lens, [1] * len(lens), num_heads, num_kv_heads, block_size, seed=block_size)
    _both(case)


def test_prefix_hits_and_sliding_window() -> None:
    lens = [19, 40, 41, 90]
    case = _case(lens, [1] * len(lens), 4, 2, 8, shared=2, seed=3)
    _both(case)
    case = _case(lens, [1] * len(lens), 4, 2, 8, shared=2, seed=4)
    _both(case, sliding_window=13)


def test_mixed_step_with_cached_prefix() -> None:
    # two decodes, then a prefill chunk after 24 cached positions and a fresh prompt
    case = _case([15, 63, 31, 9], [1, 1, 7, 9], 4, 2, 8, shared=1, seed=5)
    _both(case)


def test_float64_accumulates_in_float64() -> None:
    q, k, v, key_cache, value_cache, metadata = _case([5, 50], [1, 1], 4, 2, 8, seed=6)
    q, k, v = q.double(), k.double(), v.double()
    key_cache, value_cache = key_cache.double(), value_cache.double()
    caches = (key_cache.clone(), value_cache.clone())
    theirs = TorchAttentionBackend().forward(q, k, v, *caches, metadata, 0.25, None)
    metadata.mask_cache.clear()
    ours = TritonAttentionBackend().forward(q, k, v, key_cache, value_cache, metadata, 0.25, None)
    assert ours.dtype == torch.float64
    assert (ours - theirs).abs().max().item() < 1e-12


def test_padding_rows_are_skipped() -> None:
    """Slot -1 writes nothing; context length 0 gives zeros (a fixed-shape step's padding)."""
    q, k, v, key_cache, value_cache, metadata = _case([9, 20], [1, 1], 4, 2, 8, seed=7)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    pad_q = torch.cat([q, torch.randn(3, *q.shape[1:])])
    pad_kv = torch.randn(3, *k.shape[1:])
    slots = torch.cat([metadata.slot_mapping, torch.full((3,), -1)])
    write_kv(torch.cat([k, pad_kv]), torch.cat([v, pad_kv]), key_cache, value_cache, slots)
    write_kv(k, v, before_k, before_v, metadata.slot_mapping)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)
    tables = torch.cat([metadata.decode_block_tables, torch.zeros(3, 3, dtype=torch.long)])
    lens = torch.cat([metadata.decode_context_lens, torch.zeros(3, dtype=torch.long)])
    out = paged_decode_attention(pad_q, key_cache, value_cache, tables, lens, 0.25, block_n=16)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    alone = paged_decode_attention(q, key_cache, value_cache, tables[:2], lens[:2], 0.25)
    torch.testing.assert_close(out[:2], alone)
