"""How often a KV hand-off's blocks form one run of ids, on each side, under a steady load.

With the head-major KV cache (engine/kv_cache.py) the decode side receives each (layer, k/v,
head) in place when its reservation spans at most 8 runs, and the prefill side sends in place
where its blocks are runs too; any other layout costs a gather or scatter copy (see
benchmarks/kv_transfer_speed.py for what that costs). This script drives the real engine Scheduler and
BlockPool with no model (block bookkeeping only) and counts the runs of every transfer:

    prefill instance  Scheduler with chunked prefill and the prefix cache (prompts share system
                      prefixes); a request ends at its first token, and its blocks stay referenced
                      for --transfer-steps steps, as the KV send holds them
    decode instance   a reservation per transfer (BlockPool.allocate_run, as KVReceiver.reserve),
                      then the sequence decodes in a Scheduler (which grows its table in place)
                      until its output length, and frees

The same request stream runs twice: with allocate_run (pdserve) and with plain LRU `allocate`
everywhere (the baseline: vLLM's free-queue policy). Prints one JSON object as its last line.
Run: python -m benchmarks.block_runs [--steps 4000] [--out runs.json]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from engine.block_pool import BlockPool
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kv_transfer.config import KVTransferConfig
from kv_transfer.wire import MAX_PIECES, run_lengths

BLOCK_SIZE = 16


def num_runs(block_ids: list[int]) -> int:
    return len(run_lengths(block_ids))


def make_scheduler(pool: BlockPool, chunk_size: int) -> Scheduler:
    return Scheduler(
        pool,
        block_size=BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=chunk_size,
        chunk_size=chunk_size,
        max_model_len=16384,
    )


def simulate(args: argparse.Namespace, use_runs: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(args.prefix_len)] for _ in range(4)]
    prefill_pool, decode_pool = BlockPool(args.prefill_blocks), BlockPool(args.decode_blocks)
    if not use_runs:  # the baseline policy: LRU head everywhere
        for pool in (prefill_pool, decode_pool):
            pool.allocate_run = lambda n, after=None, pool=pool: pool.allocate(n)  # type: ignore[method-assign]
    prefill = make_scheduler(prefill_pool, args.chunk_size)
    decode = make_scheduler(decode_pool, args.chunk_size)
    # (landing step, prefill blocks the send holds, prompt request, decode blocks reserved)
    in_flight: list[tuple[int, list[int], Request, list[int]]] = []
    waiting_reserve: list[tuple[Request, list[int]]] = []
    src_runs: list[int] = []
    dst_runs: list[int] = []
    dst_in_place: list[bool] = []  # one run, or pieces the wire takes (see --head-block-bytes)
    min_piece_blocks = -(-args.min_piece_bytes // args.head_block_bytes)
    outputs: dict[str, int] = {}
    prompt_tokens = cached_tokens = 0
    decode_used: list[float] = []
    for step in range(args.steps):
        if rng.random() < args.rate:
            prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(*args.prompt_len))]
            if rng.random() < args.prefix_share:
                prompt = rng.choice(prefixes) + prompt
            rid = f"r{step}"
            outputs[rid] = rng.randint(*args.output_len)
            prefill.add_request(Request(rid, prompt, SamplingParams(max_tokens=1)))
        batch = prefill.schedule()
        for chunk in batch.chunks:
            request = prefill.requests[chunk.request_id]
            if chunk.sample:  # the prompt's last chunk: the KV send holds its blocks from now
                source = list(request.block_table)
                prefill_pool.touch(source)
                src_runs.append(num_runs(source))
                prompt_tokens += request.num_prompt_tokens
                cached_tokens += request.num_cached_tokens
                waiting_reserve.append((request, source))
        prefill.update(batch, [7] * batch.num_sampled)
        blocked = []
        for request, source in waiting_reserve:
            needed = -(-request.num_prompt_tokens // BLOCK_SIZE)
            if not decode_pool.can_allocate(needed):
                blocked.append((request, source))  # back-pressure: the reservation waits
                continue
            reserved = decode_pool.allocate_run(needed)
            dst_runs.append(num_runs(reserved))
            runs = run_lengths(reserved)
            dst_in_place.append(
                len(runs) == 1 or (len(runs) <= MAX_PIECES and min(runs) >= min_piece_blocks)
            )
            in_flight.append((step + args.transfer_steps, source, request, reserved))
        waiting_reserve = blocked
        for _, source, request, reserved in [t for t in in_flight if t[0] <= step]:
            prefill_pool.free_sequence_blocks(source)  # acknowledged: the send lets go
            max_tokens = outputs[request.request_id]
            decoded = Request(
                request.request_id,
                request.prompt_token_ids,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            decoded.output_token_ids = [7]
            decoded.block_table = reserved
            decoded.num_computed_tokens = request.num_prompt_tokens
            decode.add_prefilled(decoded)
        in_flight = [t for t in in_flight if t[0] > step]
        batch = decode.schedule()
        decode.update(batch, [7] * batch.num_sampled)
        decode_used.append(decode_pool.num_used_blocks / decode_pool.num_blocks)
    transfers = len(dst_runs)
    return {
        "transfers": transfers,
        "prefill_one_run": round(sum(r == 1 for r in src_runs) / max(1, len(src_runs)), 3),
        "prefill_two_runs": round(sum(r == 2 for r in src_runs) / max(1, len(src_runs)), 3),
        "prefill_mean_runs": round(sum(src_runs) / max(1, len(src_runs)), 2),
        "decode_one_run": round(sum(r == 1 for r in dst_runs) / max(1, transfers), 3),
        "decode_at_most_8_runs": round(sum(r <= 8 for r in dst_runs) / max(1, transfers), 3),
        # what the wire receives in place: one run, or up to MAX_PIECES runs whose per-head
        # messages carry at least min_piece_bytes each (kv_transfer.wire.WireView.for_ticket)
        "decode_in_place": round(sum(dst_in_place) / max(1, transfers), 3),
        "decode_mean_runs": round(sum(dst_runs) / max(1, transfers), 2),
        "prefill_prefix_hit_rate": round(cached_tokens / max(1, prompt_tokens), 3),
        "decode_pool_used_mean": round(sum(decode_used) / max(1, len(decode_used)), 3),
        "decode_preemptions": decode.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=0.25, help="arrivals per step")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(128, 3072))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--prefix-len", type=int, default=512, help="shared system prefix")
    parser.add_argument("--prefix-share", type=float, default=0.5)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--transfer-steps", type=int, default=2)
    parser.add_argument("--prefill-blocks", type=int, default=2048)
    parser.add_argument("--decode-blocks", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-block-bytes",
        type=int,
        default=16 * 128 * 2,
        help="one KV head of one block (block_size 16, head_dim 128, bf16): sizes the pieces",
    )
    parser.add_argument("--min-piece-bytes", type=int, default=KVTransferConfig().min_piece_bytes)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {
        "benchmark": "block_runs",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "allocate_run": simulate(args, use_runs=True),
        "lru_baseline": simulate(args, use_runs=False),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
