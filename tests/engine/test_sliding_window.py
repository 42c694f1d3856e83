"""Sliding-window layers read only the KV blocks that hold a key inside their window.

Blocks wholly before a query's window are filled with NaN: if attention read them, NaN would
reach the output (a masked-out NaN still poisons SDPA's weighted sum), so a finite output equal
to the clean cache's proves they were skipped, for decode rows and for a prefill chunk after
cached positions alike.
"""

from __future__ import annotations

import torch

from engine.attention import TorchAttentionBackend, build_attention_metadata

BLOCK_SIZE = 4
WINDOW = 6
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _attend(key_cache, value_cache, starts, news, tables, num_decodes):
    metadata, _ = build_attention_metadata(
        starts, news, tables, num_decodes, BLOCK_SIZE, torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(news)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return TorchAttentionBackend().forward(
        q, k, v, key_cache, value_cache, metadata, HEAD_DIM**-0.5, WINDOW
    )


def test_blocks_outside_the_window_are_not_read() -> None:
    num_blocks = 32
    shape = (KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    clean_k = torch.randn(shape, generator=gen, dtype=torch.float64)
    clean_v = torch.randn(shape, generator=gen, dtype=torch.float64)
    # decode rows at contexts 23 and 9, then a 5-token chunk after 17 cached positions
    tables = [list(range(0, 6)), list(range(6, 9)), list(range(9, 15))]
    starts, news = [22, 8, 17], [1, 1, 5]
    # keys before position L - WINDOW (decode) or start_pos - WINDOW + 1 (chunk) are outside
    outside = [tables[0][: (23 - WINDOW) // BLOCK_SIZE], [], tables[2][: 12 // BLOCK_SIZE]]
    assert [len(o) for o in outside] == [4, 0, 3]
    poisoned_k, poisoned_v = clean_k.clone(), clean_v.clone()
    for block in (b for row in outside for b in row):
        poisoned_k[:, block] = float("nan")
        poisoned_v[:, block] = float("nan")
    expected = _attend(clean_k, clean_v, starts, news, tables, num_decodes=2)
    got = _attend(poisoned_k, poisoned_v, starts, news, tables, num_decodes=2)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)
    # the full-attention path does read them (the poison is live)
    metadata, _ = build_attention_metadata(starts, news, tables, 2, BLOCK_SIZE, torch.device("cpu"))
    q = torch.zeros(sum(news), HEADS, HEAD_DIM, dtype=torch.float64)
    kv = torch.zeros(sum(news), KV_HEADS, HEAD_DIM, dtype=torch.float64)
    full = TorchAttentionBackend().forward(
        q, kv, kv, poisoned_k.clone(), poisoned_v.clone(), metadata, 1.0, None
    )
    assert not torch.isfinite(full[0]).all()
