"""Decode attention in groups of similar length (engine/attention/torch_backend.py): the split
is the cheapest one, and grouped attention is what one padded batch computes."""

from __future__ import annotations

import pytest
import torch

from engine.attention import (
    TorchAttentionBackend,
    build_attention_metadata,
    select_backend,
    torch_backend,
)
from engine.attention.torch_backend import split_by_length


def test_split_by_length_takes_the_cheapest_cut() -> None:
    # [2, 2, 2, 20] at 3 a group: one group costs 4*20 + 3 = 83; cut after the 2s,
    # 3*2 + 3 + 1*20 + 3 = 32; cutting further only adds group costs.
    assert split_by_length([2, 2, 2, 20], 3) == [3, 4]
    assert split_by_length([5, 5, 5, 5], 3) == [4]  # equal lengths: one group
    assert split_by_length([1, 2, 3], 100) == [3]  # a dear call: one group
    assert split_by_length([1, 10, 100], 0) == [1, 2, 3]  # a free call: each its own
    assert split_by_length([7], 3) == [1]


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_grouped_decode_matches_one_padded_batch(
    sliding_window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 2, 32
    contexts = [900, 20, 310, 33, 64, 500, 17, 120]  # decodes, out of length order
    tables, next_block = [], 0
    for n in contexts:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    tables = [t[::-1] for t in tables]  # blocks need not be in order
    starts, lens = [n - 1 for n in contexts], [1] * len(contexts)
    q = torch.randn(len(contexts), num_heads, head_dim, dtype=torch.float64)
    k, v = (torch.randn(len(contexts), num_kv_heads, head_dim, dtype=torch.float64) for _ in "kv")
    cache = torch.randn(2, num_kv_heads, next_block, block_size, head_dim, dtype=torch.float64)

    def run(cost: int, group_decodes: bool = True) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(torch_backend, "GROUP_COST_TOKENS", cost)
        meta, _ = build_attention_metadata(
            starts, lens, tables, len(contexts), block_size, torch.device("cpu")
        )
        key_cache, value_cache = cache[0].clone(), cache[1].clone()
        out = TorchAttentionBackend(cuda=not group_decodes).forward(
            q, k, v, key_cache, value_cache, meta, head_dim**-0.5, sliding_window
        )
        return out, len(meta.mask_cache.get(("decode_groups", sliding_window), []))

    if sliding_window is not None:
        # A sliding layer reads only the blocks holding its window, every row in one batch:
        # the same as full-length tables under the window's mask.
        windowed, groups = run(16)
        assert groups == 0
        monkeypatch.setattr(
            torch_backend,
            "_window_tables_and_mask",
            lambda meta, window: (
                meta.decode_block_tables,
                torch_backend._length_mask(
                    meta.decode_context_lens, meta.max_decode_context_len, window
                ),
            ),
        )
        full, _ = run(16)
        assert torch.allclose(windowed, full, rtol=0, atol=1e-12)
        return
    one, one_groups = run(10**9)
    grouped, num_groups = run(16)
    ungrouped, no_groups = run(16, group_decodes=False)  # CUDA's path: one padded batch
    assert one_groups == 1 and num_groups >= 3 and no_groups == 0
    assert torch.allclose(one, grouped, rtol=0, atol=1e-12)
    assert torch.equal(one, ungrouped)


def test_decodes_are_grouped_on_cpu_and_run_as_one_batch_on_cuda() -> None:
    """Grouping saves attention FLOPs, which is what a CPU step costs; on a GPU each group's
    extra launches and new SDPA shapes per layer cost more host time than the padding saves
    (on an H200 the engine ran 450 tokens/s with it, 570 without)."""
    assert select_backend("cpu", 16).group_decodes is True
    cuda_backend = select_backend("cuda", 16)  # flash-attn needs block sizes of 256
    assert isinstance(cuda_backend, TorchAttentionBackend) and cuda_backend.group_decodes is False
