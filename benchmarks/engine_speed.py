"""Offline throughput: pdserve's LLM against transformers' batched generate, same model and prompts.

Model: Llama, hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 1408, vocab 8192 (~31M
parameters), random weights, built once with `save_pretrained` into --model-dir. --preset picks
another shape: "1b" (TinyLlama-shaped, for GPUs) or one per model family at the 31M shape:
"qwen3", "phi3", "qwen3-moe" and "mixtral" (8 experts of width 352, top 2) and "gemma3"
(window 256 on five layers of six).
Workloads (fixed seed, every request runs to its target length: ignore_eos / EOS disabled):
  mixed    prompts uniform in [32, 512] tokens, outputs uniform in [16, 256]
  uniform  every prompt --uniform-prompt-len tokens, every output --uniform-output-len
pdserve gets all requests at once (continuous batching). transformers runs batches of 16 in
arrival order, left padded, max_new_tokens = the batch's largest target; only each request's own
target tokens count as useful. Both run in this process, same dtype and torch thread count.

    python -m benchmarks.engine_speed [--quick] [--threads 1] [--out result.json]

Prints one JSON object as the last line: per workload pdserve_tokens_per_s, hf_tokens_per_s,
ratio, peak RSS of each phase, plus the config.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine import LLM, SamplingParams

MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# A TinyLlama-shaped model (~1.1B parameters) for GPUs, where the 31M one only measures launches.
PRESETS: dict[str, dict[str, Any]] = {
    "31m": MODEL_CONFIG,
    "1b": {
        **MODEL_CONFIG,
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
    "qwen3": {**MODEL_CONFIG, "family": "qwen3", "head_dim": 64},
    "phi3": {**MODEL_CONFIG, "family": "phi3"},
    "qwen3-moe": {
        **MODEL_CONFIG,
        "family": "qwen3_moe",
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 352,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **MODEL_CONFIG,
        "family": "mixtral",
        "intermediate_size": 352,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "gemma3": {
        **MODEL_CONFIG,
        "family": "gemma3",
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 256,
    },
}
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "gemma3": Gemma3TextConfig,
}
CACHE_DIR = Path.home() / ".cache" / "pdserve"
DEFAULT_MODEL_DIR = CACHE_DIR / "bench-llama-31m"

Workload = list[tuple[list[int], int]]  # (prompt token ids, target number of output tokens)


def ensure_model(model_dir: Path, model_config: dict[str, Any] = MODEL_CONFIG) -> Path:
    """Build the random-weight benchmark model once (weights fixed by seed 0)."""
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        kwargs = dict(model_config)
        config = CONFIG_CLASSES[kwargs.pop("family", "llama")](**kwargs)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(str(model_dir))
    return model_dir


def make_workload(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int,
    vocab_size: int = MODEL_CONFIG["vocab_size"],
) -> Workload:
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_lens))]
        workload.append((prompt, rng.randint(*output_lens)))
    return workload


class PeakRss:
    """Peak resident memory of this process during a `with` block (Linux VmHWM, reset on entry)."""

    def __enter__(self) -> PeakRss:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # "5" resets the VmHWM watermark
            self.resettable = True
        except OSError:
            self.resettable = False  # fall back to the process-lifetime peak
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.peak_mb = _vm_hwm_mb() if self.resettable else _lifetime_peak_mb()


def _vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return _lifetime_peak_mb()


def _lifetime_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pdserve(llm: LLM, workload: Workload) -> int:
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [n for _, n in workload]
    return sum(len(o.token_ids) for o in outputs)


def run_hf(model: Any, workload: Workload, batch_size: int) -> int:
    useful = 0
    device = model.device
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        max_prompt = max(len(p) for p, _ in batch)
        input_ids = torch.tensor([[0] * (max_prompt - len(p)) + p for p, _ in batch], device=device)
        attention_mask = torch.tensor(
            [[0] * (max_prompt - len(p)) + [1] * len(p) for p, _ in batch], device=device
        )
        max_new_tokens = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.shape[1] == max_prompt + max_new_tokens  # every row ran the whole batch
        useful += sum(n for _, n in batch)
    return useful


def timed(fn: Callable[[], int]) -> tuple[int, float, float]:
    """(tokens, seconds, peak RSS MB) of one call."""
    with PeakRss() as rss:
        start = time.perf_counter()
        tokens = fn()
        seconds = time.perf_counter() - start
    return tokens, seconds, rss.peak_mb


def bench_workload(
    name: str, workload: Workload, llm: LLM, hf: PreTrainedModel, hf_batch_size: int
) -> dict[str, Any]:
    ours_tokens, ours_s, ours_rss = timed(lambda: run_pdserve(llm, workload))
    hf_tokens, hf_s, hf_rss = timed(lambda: run_hf(hf, workload, hf_batch_size))
    stats = llm.stats
    result = {
        "num_requests": len(workload),
        "num_prompt_tokens": sum(len(p) for p, _ in workload),
        "num_output_tokens": ours_tokens,
        "pdserve_s": round(ours_s, 3),
        "hf_s": round(hf_s, 3),
        "pdserve_tokens_per_s": round(ours_tokens / ours_s, 2),
        "hf_tokens_per_s": round(hf_tokens / hf_s, 2),
        "ratio": round((ours_tokens / ours_s) / (hf_tokens / hf_s), 3),
        "pdserve_peak_rss_mb": round(ours_rss, 1),
        "hf_peak_rss_mb": round(hf_rss, 1),
        "pdserve_preemptions_total": stats.num_preemptions,
    }
    print(f"[{name}] {json.dumps(result)}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both systems)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--uniform-prompt-len", type=int, default=256)
    parser.add_argument("--uniform-output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--workloads", default="mixed,uniform")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both systems)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="31m", help="model shape")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="pdserve's KV pool")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: by preset")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    num_requests, prompt_lens, output_lens = args.num_requests, (32, 512), (16, 256)
    uniform = (args.uniform_prompt_len, args.uniform_output_len)
    if args.quick:
        num_requests, prompt_lens, output_lens, uniform = 8, (8, 64), (4, 16), (32, 8)
    model_config = PRESETS[args.preset]
    vocab_size = model_config["vocab_size"]
    workloads = {
        "mixed": make_workload(num_requests, prompt_lens, output_lens, args.seed, vocab_size),
        "uniform": make_workload(
            num_requests, (uniform[0], uniform[0]), (uniform[1], uniform[1]), args.seed, vocab_size
        ),
    }
    family = model_config.get("family", "llama")
    name = f"bench-llama-{args.preset}" if family == "llama" else f"bench-{args.preset}"
    model_dir = ensure_model(args.model_dir or CACHE_DIR / name, model_config)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device).eval()
    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "num_threads": args.threads,
        "device": args.device,
    }
    if args.kv_cache_gb is not None:
        engine_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gb * 2**30)
    results: dict[str, Any] = {}
    with LLM(str(model_dir), dtype=args.dtype, **engine_kwargs) as llm:
        warmup = make_workload(2, (8, 16), (4, 4), args.seed + 1, vocab_size)
        run_pdserve(llm, warmup)
        run_hf(hf, warmup, args.hf_batch_size)
        for name in args.workloads.split(","):
            results[name] = bench_workload(name, workloads[name], llm, hf, args.hf_batch_size)
        engine_config = llm.engine.config
    summary = {
        "benchmark": "engine",
        "workloads": results,
        "config": {
            "model": {k: model_config[k] for k in list(model_config)[:6]},
            "family": family,
            "preset": args.preset,
            "device": args.device,
            "num_parameters": sum(p.numel() for p in hf.parameters()),
            "dtype": args.dtype,
            "threads": args.threads,
            "seed": args.seed,
            "quick": args.quick,
            "hf_batch_size": args.hf_batch_size,
            "mixed": {"prompt_lens": prompt_lens, "output_lens": output_lens},
            "uniform": {"prompt_len": uniform[0], "output_len": uniform[1]},
            "block_size": engine_config.block_size,
            "max_num_seqs": engine_config.max_num_seqs,
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "chunk_size": engine_config.chunk_size,
            "num_kv_blocks": llm.engine.block_pool.num_blocks,
        },
    }
    line = json.dumps(summary)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    main()
