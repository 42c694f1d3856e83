"""KV transfer timing for `pdserve profile`: one request's KV, prefill rank -> decode rank.

Two spawned rank processes (benchmarks/kv_transfer_ranks.py: each owns a KV cache of the model's
shape, the decode one a channel host) move whole requests of a few sizes over the real
kv_transfer channel (KVRankSender -> KVRankReceiver), from the prefill rank's start to the decode
rank's landing on one monotonic clock. planner/fit.fit_transfer turns (bytes, ms) into a
bandwidth and a per-message cost. At TP > 1 rank 0 -> rank 0 is timed with its head share;
the rank pairs move their slices at once, so the fit prices the whole model's bytes.
"""

from __future__ import annotations

import statistics
from typing import Any

from planner.fit import fit_transfer


def _ticket(
    tid: int, tokens: int, block_size: int, tp: int, endpoint: Any, kv_cache_dtype: str
) -> Any:
    from kv_transfer.messages import KVTicket

    num_blocks = -(-tokens // block_size)
    return KVTicket(
        request_id=f"profile-kv-{tid}",
        transfer_id=tid,
        block_ids=tuple(range(num_blocks)),
        num_tokens=tokens,
        prefill_instance_id="P",
        prefill_tp_size=tp,
        decode_instance_id="D",
        decode_tp_size=tp,
        decode_endpoints=(endpoint,) * tp,
        layerwise=False,
        timeout_s=60.0,
        kv_cache_dtype=kv_cache_dtype,
    )


# The largest transfer moves at least this much: below it (a test's tiny model: 512 bytes a
# token, 1 MB for 2048 tokens, ~0.6 ms) scheduling noise outweighs the bytes and the fitted
# slope can come out <= 0 (seen in CI). Token counts scale up for such a model.
MIN_LARGEST_TRANSFER_BYTES = 8 * 1024 * 1024


def transfer_token_sizes(grid_tokens: tuple[int, ...], bytes_per_token: int) -> list[int]:
    """The grid's token counts, scaled so that the largest moves MIN_LARGEST_TRANSFER_BYTES."""
    largest = max(grid_tokens) * bytes_per_token
    scale = max(1, -(-MIN_LARGEST_TRANSFER_BYTES // largest))
    return [tokens * scale for tokens in grid_tokens]


def measure_transfer(
    config: Any, tp: int, grid: Any, log: Any
) -> tuple[float, float, list[list[float]]]:
    """(GB/s, per-message ms, [[tokens, bytes, ms], ...]) for `grid.transfer_tokens` (scaled up
    for a model whose KV is too small to time, `transfer_token_sizes`)."""
    import torch

    from benchmarks.kv_transfer_ranks import (
        Endpoint,
        Recv,
        Send,
        WaitRecv,
        start_bench_workers,
    )
    from engine.kv_cache import KVCacheSpec
    from engine.model_config import ModelConfig

    model = ModelConfig.from_model_dir(config.model_dir)
    block_size = config.block_size
    kv_dtype = config.kv_cache_dtype
    # the whole model's KV (every head) per block, as the rank caches store it (float32, or
    # 8 bits and scales: kv_cache.dtype)
    bytes_per_block = KVCacheSpec(
        model.num_layers, 1, block_size, model.num_kv_heads, model.head_dim, torch.float32, kv_dtype
    ).bytes_per_block
    token_sizes = transfer_token_sizes(tuple(grid.transfer_tokens), bytes_per_block // block_size)
    num_blocks = -(-max(token_sizes) // block_size) + 1
    spec = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_dtype)
    prefill, decode, _ = start_bench_workers(1, 1, spec)
    points: list[list[float]] = []
    try:
        endpoint = decode[0].call(Endpoint())
        tid = 0
        for tokens in token_sizes:
            times = []
            for _ in range(grid.repeats + 1):  # the first one warms the channel up
                tid += 1
                ticket = _ticket(tid, tokens, block_size, tp, endpoint, kv_dtype)
                decode[0].call(Recv(ticket, 0))
                prefill[0].post(Send(ticket, 0, list(ticket.block_ids)))
                decode[0].post(WaitRecv())
                start = prefill[0].reply()
                times.append((decode[0].reply() - start) * 1e3)
            blocks = -(-tokens // block_size)
            # The whole model's KV (every head): the tp rank pairs move their slices at once.
            num_bytes = blocks * bytes_per_block
            points.append([tokens, float(num_bytes), statistics.median(times[1:])])
    finally:
        for worker in prefill + decode:
            worker.stop()
    bandwidth, per_message = fit_transfer([(int(b), ms) for _, b, ms in points])
    log(f"tp={tp}: KV transfer {bandwidth:.2f} GB/s + {per_message:.2f} ms per message")
    return bandwidth, per_message, points
