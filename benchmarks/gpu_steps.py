"""Decode steps on the GPU: host time against GPU time, launches per step, and the HBM roofline.

For each variant (the GPU switches: `default`, `no-graphs`, `torch-attn`, `no-fused`) one
ModelRunner over the model; for each batch size a pure-decode step of that many sequences at
context --context-len (random KV: attention cost does not depend on the values), then:
  host_ms   from the step's start until ModelRunner.execute returns (the host's work)
  gpu_ms    between CUDA events recorded around it (the GPU's work)
  wall_ms   until the sampled tokens are on the host (the one sync)
  launches  kernel and graph launches per step, counted by torch.profiler
The roofline of the batch-64 step is the bytes it must read (every weight but the input
embedding, of which it reads 64 rows, plus the KV of 64 contexts) over the chip's HBM bandwidth
(the data sheet's, by device name; a measured copy bandwidth where the name is unknown).

    python -m benchmarks.gpu_steps --model-dir DIR [--variants default,no-graphs] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine import parallel
from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-graphs": {"cuda_graphs": False},
    "torch-attn": {"attention_backend": "torch"},
    "no-fused": {"fused_ops": False},
}
# Data-sheet HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
HBM_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100": 1.555e12,
}


def spec_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in HBM_BANDWIDTH.items() if key in name), None)


def measured_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (it reads and writes each byte once)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * 5 / (time.perf_counter() - start)


def decode_batch(batch_size: int, context_len: int, block_size: int, vocab: int) -> ScheduledBatch:
    blocks_each = -(-context_len // block_size)
    gen = torch.Generator().manual_seed(batch_size)
    chunks = []
    for i in range(batch_size):
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        token = int(torch.randint(3, vocab, (1,), generator=gen))
        chunks.append(SequenceChunk(f"r{i}", [token], context_len - 1, table))
    return ScheduledBatch(chunks)


def time_steps(runner: ModelRunner, batch: ScheduledBatch, steps: int) -> dict[str, float]:
    """Median host, GPU (CUDA only) and wall milliseconds of `steps` steps after 3 warm-ups."""
    cuda = runner.device.type == "cuda"
    host, gpu, wall = [], [], []
    for step in range(steps + 3):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        start = time.perf_counter()
        if events:
            events[0].record()
        logits = runner.execute(batch)
        launched = time.perf_counter()
        if events:
            events[1].record()
        logits.argmax(dim=-1).tolist()  # the step's one sync, as the sampler has it
        done = time.perf_counter()
        if step >= 3:  # warm-up: Triton compiles, caches fill
            host.append((launched - start) * 1e3)
            wall.append((done - start) * 1e3)
            if events:
                gpu.append(events[0].elapsed_time(events[1]))
    row = {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall)}
    if gpu:
        row["gpu_ms"] = statistics.median(gpu)
    return {key: round(value, 3) for key, value in row.items()}


def count_launches(runner: ModelRunner, batch: ScheduledBatch, steps: int = 3) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.execute(batch).argmax(dim=-1).tolist()
    names = ("LaunchKernel", "GraphLaunch", "cuLaunchKernel")
    launches = sum(e.count for e in prof.key_averages() if any(n in e.key for n in names))
    return launches / steps


def roofline_ms(runner: ModelRunner, batch_size: int, context_len: int, bandwidth: float) -> float:
    model = runner.model
    elem = runner.dtype.itemsize
    embed = model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head.weight is not embed:  # the input embedding: only the batch's rows are read
        weights -= embed.numel() * embed.element_size() - batch_size * embed.shape[1] * elem
    spec = runner.kv_cache.spec
    kv = batch_size * context_len * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem
    return (weights + kv) / bandwidth * 1e3


def run_variant(name: str, args: argparse.Namespace, blocks: int) -> dict[str, Any]:
    parallel.set_tp_group(None, 0, 1)
    config = EngineConfig(
        model_dir=str(args.model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=blocks,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.context_len + 16,
        **VARIANTS[name],
    )
    start = time.perf_counter()
    runner = ModelRunner(config)
    ready_s = time.perf_counter() - start
    graphs = runner.decode_graphs
    result: dict[str, Any] = {
        "backend": runner.backend.name,
        "cuda_graphs": bool(graphs is not None and graphs.graphs),
        "fused_ops": runner.model.fused_ops,
        "startup_s": round(ready_s, 2),
        "batches": {},
    }
    vocab = runner.model_config.vocab_size
    for batch_size in args.batch_sizes:
        batch = decode_batch(batch_size, args.context_len, args.block_size, vocab)
        row = time_steps(runner, batch, args.steps)
        if (
            args.launches
            and runner.device.type == "cuda"
            and (name == "default" or batch_size == 64)
        ):
            row["launches"] = count_launches(runner, batch)
        result["batches"][str(batch_size)] = row
        print(f"[{name}] batch {batch_size}: {json.dumps(row)}", flush=True)
    result["runner"] = runner
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-launches", dest="launches", action="store_false")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    cuda = device.type == "cuda"  # CPU: a smoke run of the script, no GPU figures
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    blocks = max(args.batch_sizes) * -(-args.context_len // args.block_size) + 16
    spec_bw = spec_bandwidth(name)
    measured_bw = round(measured_bandwidth(device)) if cuda else None
    result: dict[str, Any] = {
        "gpu": name,
        "context_len": args.context_len,
        "hbm_bandwidth_spec": spec_bw,
        "hbm_bandwidth_measured": measured_bw,
        "variants": {},
    }
    bandwidth = spec_bw or measured_bw
    for variant in args.variants.split(","):
        row = run_variant(variant, args, blocks)
        runner = row.pop("runner")
        if variant == "default" and "64" in row["batches"] and bandwidth:
            roof = roofline_ms(runner, 64, args.context_len, bandwidth)
            wall = row["batches"]["64"]["wall_ms"]
            result["decode_step_roofline_ms_b64"] = round(roof, 3)
            result["decode_step_roofline_ratio_b64"] = round(wall / roof, 2)
        result["variants"][variant] = row
        del runner
        if cuda:
            torch.cuda.empty_cache()
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
