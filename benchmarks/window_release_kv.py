"""Resident KV of one long request on a model whose every layer slides, with the blocks wholly
before the window given back and without (torch back end, CPU).

One block table serves every layer, so a block can go back to the pool only once no layer's
window reaches it: a model whose every layer slides (Mistral, Mixtral) gives back all but the
last (W - 1) // block_size + 2 blocks of a request, from its chunked prefill on; a model with
a full-attention layer (Gemma 2/3) keeps every block (`benchmarks.sliding_window_kv` measures
what its attention skips reading instead).

Model: Mistral-shaped with random weights, 4 layers all sliding (window --window), hidden 256,
4 query heads / 1 KV head of 64. One prompt of --context tokens, then --decode-tokens greedy
tokens, once with release and once with the scheduler's release turned off (same tokens).
The figures are the most blocks in use at any allocation (a prefill chunk's included), times
the bytes of a block (K and V, every layer).

    python -m benchmarks.window_release_kv [--context 8192] [--window 512] [--out PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, MistralConfig

from benchmarks.window_bench import default_model_dir, long_prompt, open_llm, parse_window_args
from engine import LLM, SamplingParams

NUM_LAYERS = 4


def ensure_model(model_dir: Path, window: int, max_positions: int) -> Path:
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        config = MistralConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            sliding_window=window,
            max_position_embeddings=max_positions,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(str(model_dir))
    return model_dir


def peak_blocks(
    llm: LLM, prompt: list[int], decode_tokens: int, release: bool, request_id: str
) -> tuple[int, list[int]]:
    """The most blocks in use after any step of one request, and its tokens."""
    engine = llm.engine
    window = engine.scheduler.release_window
    engine.scheduler.release_window = window if release else None
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    )
    tokens: list[int] = []
    pool = engine.block_pool
    allocate_run = pool.allocate_run
    peak = [0]

    def counted(*args: Any, **kwargs: Any) -> list[int]:
        block_ids = allocate_run(*args, **kwargs)
        peak[0] = max(peak[0], pool.num_used_blocks)  # a step's chunk included
        return block_ids

    pool.allocate_run = counted  # type: ignore[method-assign]
    try:
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
    finally:
        engine.scheduler.release_window = window
        pool.allocate_run = allocate_run  # type: ignore[method-assign]
    return peak[0], tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_window_args(argv, __doc__.split("\n")[0], decode_tokens=64)
    model_dir = ensure_model(default_model_dir(args, "mistral"), args.window, args.max_positions)
    prompt = long_prompt(args)
    with open_llm(args, model_dir) as llm:
        assert llm.engine.scheduler.release_window == args.window
        released, tokens = peak_blocks(llm, prompt, args.decode_tokens, True, "release")
        kept, baseline = peak_blocks(llm, prompt, args.decode_tokens, False, "keep")
        spec = llm.engine.executor.kv_cache.spec
        chunk_size = llm.engine.config.chunk_size
    assert tokens == baseline, "outputs differ"
    block_bytes = 2 * NUM_LAYERS * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    block_bytes *= args.block_size
    summary = {
        "benchmark": "window_release_kv",
        "peak_kv_bytes_released": released * block_bytes,
        "peak_kv_bytes_kept": kept * block_bytes,
        "kv_bytes_saved": (kept - released) * block_bytes,
        "ratio": round(kept / released, 3),
        "peak_blocks_released": released,
        "peak_blocks_kept": kept,
        "config": {
            "context": args.context,
            "window": args.window,
            "layers": NUM_LAYERS,
            "block_size": args.block_size,
            "decode_tokens": args.decode_tokens,
            "chunk_size": chunk_size,
            "dtype": str(spec.dtype),
        },
    }
    line = json.dumps(summary)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    main()
