"""Micro-benchmark of one model step: pdserve's executor vs the transformers model with its cache.

Model: ~30M params (hidden 512, 8 layers, 8 heads / 2 KV heads, vocab 8192), float32, CPU.
Measures (median ms per step):
  decode_b{1,8,32}: one decode step for a batch whose contexts are ~300 tokens
  prefill_512:      one 512-token prompt
HF runs the same shapes (uniform lengths, no padding) through `model(input_ids, cache=...)`.

    python -m benchmarks.forward_micro [--threads 1] [--steps 20] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.executor import Executor

CONTEXT_LEN = 300
BLOCK_SIZE = 16


def build_model(model_dir: str) -> None:
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)


def median_ms(step: Callable[[], object], num_steps: int) -> float:
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def ours_decode_ms(executor: Executor, batch_size: int, num_steps: int) -> float:
    num_blocks = -(-(CONTEXT_LEN + num_steps + 1) // BLOCK_SIZE)
    tables = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(batch_size)]
    prompts = torch.randint(3, 8192, (batch_size, CONTEXT_LEN)).tolist()
    executor.execute(
        ScheduledBatch([SequenceChunk(str(i), prompts[i], 0, tables[i]) for i in range(batch_size)])
    )
    position = [CONTEXT_LEN]

    def step() -> None:
        executor.execute(
            ScheduledBatch(
                [SequenceChunk(str(i), [7], position[0], tables[i]) for i in range(batch_size)]
            )
        )
        position[0] += 1

    return median_ms(step, num_steps)


def hf_decode_ms(model: LlamaForCausalLM, batch_size: int, num_steps: int) -> float:
    cache = DynamicCache(config=model.config)
    prompts = torch.randint(3, 8192, (batch_size, CONTEXT_LEN))
    with torch.no_grad():
        model(prompts, cache=cache, use_cache=True)
    next_ids = torch.full((batch_size, 1), 7)

    def step() -> None:
        with torch.no_grad():
            model(next_ids, cache=cache, use_cache=True)

    return median_ms(step, num_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = tempfile.mkdtemp(prefix="pdserve-micro-")
    build_model(model_dir)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=32 * 24,
        num_threads=args.threads,
    )
    result: dict[str, float] = {}
    with Executor(config) as executor:
        for batch_size in (1, 8, 32):
            ours = ours_decode_ms(executor, batch_size, args.steps)
            theirs = hf_decode_ms(hf, batch_size, args.steps)
            result[f"decode_b{batch_size}_ms"] = round(ours, 3)
            result[f"hf_decode_b{batch_size}_ms"] = round(theirs, 3)
            result[f"decode_b{batch_size}_speedup"] = round(theirs / ours, 3)
            print(f"decode b={batch_size}: pdserve {ours:.2f} ms, hf {theirs:.2f} ms", flush=True)
        prompt = torch.randint(3, 8192, (512,)).tolist()
        table = list(range(512 // BLOCK_SIZE))
        ours = median_ms(
            lambda: executor.execute(ScheduledBatch([SequenceChunk("p", prompt, 0, table)])),
            max(3, args.steps // 4),
        )
    with torch.no_grad():
        theirs = median_ms(lambda: hf(torch.tensor([prompt])), max(3, args.steps // 4))
    result.update(
        prefill_512_ms=round(ours, 3),
        hf_prefill_512_ms=round(theirs, 3),
        prefill_512_speedup=round(theirs / ours, 3),
    )
    print(f"prefill 512: pdserve {ours:.2f} ms, hf {theirs:.2f} ms", flush=True)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
