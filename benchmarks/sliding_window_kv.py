"""KV bytes a sliding-window model's attention reads per decode step, with and without skipping
the blocks outside each layer's window, on one long context (torch back end, CPU).

Model: Gemma-3-shaped with random weights: 6 layers, five sliding (window --window) and one
full, as the published Gemma 3 models interleave them; hidden 256, 4 query heads / 1 KV head
of 64. One prompt of --context tokens, then --decode-tokens greedy tokens. "skipping" is the
engine as it is; "reading all" swaps in the tables and masks of full-length attention (same
output, every block read) for the baseline. Bytes are the K and V the attention gathers, summed
over layers: measured by counting every gather, not computed.

The resident KV is the same both ways: the cache is one tensor [layers, 2, heads, blocks, ...]
in which a block id holds its tokens for every layer, so a block returns to the pool only when
no layer needs it, and a full-attention layer needs every block. What a per-layer-group pool
could give back is printed as `resident_bytes_outside_windows` (not implemented).

    python -m benchmarks.sliding_window_kv [--context 8192] [--window 512] [--out PATH]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from benchmarks.window_bench import default_model_dir, long_prompt, open_llm, parse_window_args
from engine import LLM, SamplingParams
from engine.attention import torch_backend

LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def ensure_model(model_dir: Path, window: int, max_positions: int) -> Path:
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        config = Gemma3TextConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=len(LAYER_TYPES),
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=window,
            layer_types=LAYER_TYPES,
            max_position_embeddings=max_positions,
            pad_token_id=0,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(str(model_dir))
    return model_dir


@contextmanager
def counting_gathers(read_all: bool) -> Iterator[list[int]]:
    """Count the bytes every KV gather returns; `read_all`: full-length tables and masks."""
    counter = [0]
    gather, window_tables, first_block = (
        torch_backend._gather_blocks,
        torch_backend._window_tables_and_mask,
        torch_backend._first_window_block,
    )

    def counted(cache: torch.Tensor, tables: torch.Tensor, *rest: Any) -> torch.Tensor:
        out = gather(cache, tables, *rest)
        counter[0] += out.numel() * out.element_size()
        return out

    def all_tables(metadata: Any, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        lens = metadata.decode_context_lens
        mask = torch_backend._length_mask(lens, metadata.max_decode_context_len, window)
        return metadata.decode_block_tables, mask

    torch_backend._gather_blocks = counted  # type: ignore[assignment]
    if read_all:
        torch_backend._window_tables_and_mask = all_tables  # type: ignore[assignment]
        torch_backend._first_window_block = lambda chunk, block_size, window: 0  # type: ignore[assignment]
    try:
        yield counter
    finally:
        torch_backend._gather_blocks = gather  # type: ignore[assignment]
        torch_backend._window_tables_and_mask = window_tables  # type: ignore[assignment]
        torch_backend._first_window_block = first_block  # type: ignore[assignment]


def measure(
    llm: LLM, prompt: list[int], decode_tokens: int, read_all: bool, request_id: str
) -> dict[str, Any]:
    """Bytes read and median time of each decode step, after the prompt's prefill steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    step_s: list[float] = []
    with counting_gathers(read_all) as counter:
        while not tokens:  # prefill (chunked) until the first token
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        counter[0] = 0
        while engine.has_unfinished():
            start = time.perf_counter()
            outputs = engine.step()
            step_s.append(time.perf_counter() - start)
            tokens += [t for out in outputs for t in out.new_token_ids]
        decode_bytes = counter[0]
    return {
        "kv_bytes_read_per_decode_step": decode_bytes // len(step_s),
        "decode_ms_per_step": round(1000 * statistics.median(step_s), 3),
        "token_ids": tokens,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_window_args(argv, __doc__.split("\n")[0], decode_tokens=32)
    model_dir = ensure_model(default_model_dir(args, "gemma3"), args.window, args.max_positions)
    prompt = long_prompt(args)
    with open_llm(args, model_dir) as llm:
        skipping = measure(llm, prompt, args.decode_tokens, False, "skipping")
        reading_all = measure(llm, prompt, args.decode_tokens, True, "reading-all")
        spec = llm.engine.executor.kv_cache.spec
    assert skipping.pop("token_ids") == reading_all.pop("token_ids"), "outputs differ"
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    num_sliding = LAYER_TYPES.count("sliding_attention")
    context = args.context + args.decode_tokens
    saved = reading_all["kv_bytes_read_per_decode_step"] - skipping["kv_bytes_read_per_decode_step"]
    summary = {
        "benchmark": "sliding_window_kv",
        "skipping": skipping,
        "reading_all": reading_all,
        "kv_bytes_read_saved_per_decode_step": saved,
        "read_ratio": round(
            reading_all["kv_bytes_read_per_decode_step"]
            / skipping["kv_bytes_read_per_decode_step"],
            3,
        ),
        "decode_speedup": round(
            reading_all["decode_ms_per_step"] / skipping["decode_ms_per_step"], 3
        ),
        "resident_kv_bytes": context * len(LAYER_TYPES) * per_token_layer,
        "resident_bytes_outside_windows": max(0, context - args.window)
        * num_sliding
        * per_token_layer,
        "config": {
            "context": args.context,
            "window": args.window,
            "layer_types": LAYER_TYPES,
            "block_size": args.block_size,
            "decode_tokens": args.decode_tokens,
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
