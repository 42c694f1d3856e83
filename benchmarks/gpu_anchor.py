"""nano-vllm's throughput workload, the one vLLM's and nano-vllm's published figures use.

256 sequences, prompts of random token ids with lengths uniform in [100, 1024], outputs of
lengths uniform in [100, 1024] (every request runs to its length: EOS ignored), temperature 0.6,
all submitted at once; output tokens per second of wall time. pdserve runs it --runs times (the
median is the figure; a short warm-up generation first, as nano-vllm's bench.py does);
transformers runs it once, all 256 sequences in one left-padded `generate` (only each request's
own output length counts as useful).

    python -m benchmarks.gpu_anchor --model-dir DIR --system pdserve --runs 3 [--out F]
    python -m benchmarks.gpu_anchor --model-dir DIR --system transformers [--out F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams

Workload = list[tuple[list[int], int]]


def anchor_workload(num_seqs: int, max_len: int, vocab_size: int, seed: int = 0) -> Workload:
    """nano-vllm bench.py's: ids in [0, 10000], lengths uniform in [100, max_len]."""
    rng = random.Random(seed)
    top = min(10000, vocab_size - 1)
    workload = []
    for _ in range(num_seqs):
        prompt = [rng.randint(0, top) for _ in range(rng.randint(100, max_len))]
        workload.append((prompt, rng.randint(100, max_len)))
    return workload


def run_pdserve(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    llm_args: dict[str, Any] = dict(
        device=args.device,
        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
        max_num_seqs=len(workload),
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_size=args.max_num_batched_tokens,
        cuda_graphs=not args.no_graphs,
        attention_backend=args.attention_backend,
        fused_ops=False if args.no_fused else None,
    )
    start = time.perf_counter()
    llm = LLM(str(args.model_dir), dtype=args.dtype, **llm_args)
    startup_s = time.perf_counter() - start
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up
    runs = []
    for _ in range(args.runs):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        assert tokens == sum(n for _, n in workload)
        runs.append(round(tokens / seconds, 1))
        print(f"[pdserve] {tokens} tokens in {seconds:.2f} s: {runs[-1]} tokens/s", flush=True)
    runner = llm.engine.executor._runner
    return {
        "tokens_per_s": statistics.median(runs),
        "runs_tokens_per_s": runs,
        "startup_s": round(startup_s, 2),
        "backend": runner.backend.name,
        "cuda_graphs": bool(runner.decode_graphs is not None and runner.decode_graphs.graphs),
        "fused_ops": runner.model.fused_ops,
        "preemptions": llm.stats.num_preemptions,
    }


def run_transformers(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=args.dtype)
    model = model.to(args.device).eval()
    longest = max(len(p) for p, _ in workload)
    pad = [longest - len(p) for p, _ in workload]
    input_ids = torch.tensor([[0] * n + p for n, (p, _) in zip(pad, workload, strict=True)])
    mask = torch.tensor([[0] * n + [1] * len(p) for n, (p, _) in zip(pad, workload, strict=True)])
    max_new = max(n for _, n in workload)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=input_ids.to(args.device),
            attention_mask=mask.to(args.device),
            do_sample=True,
            temperature=0.6,
            top_k=0,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - start
    useful = sum(n for _, n in workload)
    print(f"[transformers] {useful} useful tokens in {seconds:.2f} s", flush=True)
    return {"tokens_per_s": round(useful / seconds, 1), "seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--system", choices=("pdserve", "transformers"), default="pdserve")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gb", type=float, default=24.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-fused", action="store_true")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    vocab_size = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    workload = anchor_workload(args.num_seqs, args.max_len, vocab_size)
    run = run_pdserve if args.system == "pdserve" else run_transformers
    result = {
        "system": args.system,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "num_seqs": args.num_seqs,
        "num_output_tokens": sum(n for _, n in workload),
        **run(args, workload),
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
