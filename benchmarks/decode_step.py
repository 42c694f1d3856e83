"""Per decode step: how long one step takes at batch 1, 8, 32 and 64, and how much of it is
the scheduler and bookkeeping rather than the model.

Model: the engine benchmark's (benchmarks/engine_speed.py: Llama, hidden 512, 8 layers, 8 heads / 2 KV
heads, intermediate 1408, vocab 8192, random weights), float32, 1 torch thread by default.
LLMEngine's real components (Scheduler, Sampler, Executor) run one step exactly as
`LLMEngine.step` does, with a clock around each phase:

    schedule -> executor.execute -> sampling_rows -> sampler -> update
    overhead = schedule + sampling_rows + sampler + update       (everything but execute)
    overhead_share = overhead / step time

For reference, the model runner's own per-step bookkeeping (`prepare_inputs`: block tables to slot
mappings and attention metadata, part of execute) is timed on the same batch by a second,
separate call, outside the step clock, and reported as `runner_prepare_inputs_ms`.

The largest batch is prefilled once (prompts of a few hundred tokens); smaller batches are made
by aborting sequences, so every measured step is a pure decode step over long contexts.

    python -m benchmarks.decode_step [--steps 30] [--threads 1] [--out result.json]
    python -m benchmarks.decode_step --min-prompt-len 16 --max-prompt-len 900 --compare-groups

`--compare-groups` measures each batch twice more, its decode attention in one padded group (the
baseline) and in groups of similar length (engine/attention/torch_backend.py), alternating, and
reports both medians and their ratio (`grouped_speedup`): what grouping gains at spread contexts.

Prints one JSON object as the last line: per batch size `batch`, `step_ms`, `overhead_share`
and the per-phase split (ms per step), plus the config.
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

from benchmarks.engine_speed import DEFAULT_MODEL_DIR, MODEL_CONFIG, ensure_model
from engine import EngineConfig, LLMEngine, SamplingParams

PHASES = ("schedule", "execute", "sampling_rows", "sampler", "update")
TARGET_BATCH, TARGET_SHARE = 32, 0.10


def timed_step(engine: LLMEngine) -> dict[str, float]:
    """One LLMEngine.step, phase by phase; seconds per phase (PHASES), plus the runner's
    prepare_inputs on the same batch, timed apart (not part of the step)."""
    scheduler, sampler, executor = engine.scheduler, engine.sampler, engine.executor
    t0 = time.perf_counter()
    batch = scheduler.schedule()
    t1 = time.perf_counter()
    executor.runner.prepare_inputs(batch)  # pure: builds tensors, touches no state
    prepare_s = time.perf_counter() - t1
    t_execute = time.perf_counter()
    logits = executor.execute(batch)  # [batch.num_sampled, vocab_size]
    t2 = time.perf_counter()
    rows = scheduler.sampling_rows(batch)
    t3 = time.perf_counter()
    sampled = sampler(logits, rows)
    t4 = time.perf_counter()
    scheduler.update(batch, sampled)
    t5 = time.perf_counter()
    phases = dict(zip(PHASES, (t1 - t0, t2 - t_execute, t3 - t2, t4 - t3, t5 - t4), strict=True))
    return {**phases, "runner_prepare_inputs": prepare_s}


def prefill(
    engine: LLMEngine, batch_size: int, prompt_lens: tuple[int, int], max_tokens: int, seed: int
) -> None:
    """Queue `batch_size` greedy requests and step until every one is decoding."""
    rng = random.Random(seed)
    vocab_size = MODEL_CONFIG["vocab_size"]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_lens))]
        engine.add_request(f"seq-{i}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running
    ):
        engine.step()
    assert len(scheduler.running) == batch_size, "the pool is too small for the batch"


def shrink_to(engine: LLMEngine, batch_size: int) -> None:
    """Abort the newest sequences until `batch_size` run; one step reports the aborts."""
    running = engine.scheduler.running
    for request in list(running[batch_size:]):
        engine.abort(request.request_id)
    engine.step()
    assert len(engine.scheduler.running) == batch_size


def measure(engine: LLMEngine, num_warmup: int, num_steps: int) -> dict[str, Any]:
    batch_size = len(engine.scheduler.running)
    for _ in range(num_warmup):
        timed_step(engine)
    steps = [timed_step(engine) for _ in range(num_steps)]
    assert len(engine.scheduler.running) == batch_size, "a sequence ended while measuring"
    step_s = [sum(step[phase] for phase in PHASES) for step in steps]
    total = {phase: sum(step[phase] for step in steps) for phase in PHASES}
    prepare_s = sum(step["runner_prepare_inputs"] for step in steps)
    overhead_s = sum(total.values()) - total["execute"]
    context_lens = [r.num_tokens for r in engine.scheduler.running]
    return {
        "batch": batch_size,
        "step_ms": round(1000 * sum(step_s) / num_steps, 3),
        "step_ms_p50": round(1000 * statistics.median(step_s), 3),
        "overhead_share": round(overhead_s / sum(step_s), 4),
        "overhead_ms": round(1000 * overhead_s / num_steps, 3),
        "split_ms": {phase: round(1000 * total[phase] / num_steps, 3) for phase in PHASES},
        "runner_prepare_inputs_ms": round(1000 * prepare_s / num_steps, 3),
        "mean_context_len": round(sum(context_lens) / batch_size, 1),
    }


def compare_groups(engine: LLMEngine, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Median step with the decode attention in one padded group and in length groups,
    alternating rounds so that the contexts' growth falls on both."""
    from engine.attention import torch_backend

    grouped_cost, medians = torch_backend.GROUP_COST_TOKENS, {"one_group": [], "grouped": []}
    try:
        for _ in range(2):
            for name, cost in (("one_group", 1 << 40), ("grouped", grouped_cost)):
                torch_backend.GROUP_COST_TOKENS = cost
                medians[name].append(measure(engine, num_warmup, num_steps // 2)["step_ms_p50"])
    finally:
        torch_backend.GROUP_COST_TOKENS = grouped_cost
    one, grouped = statistics.median(medians["one_group"]), statistics.median(medians["grouped"])
    return {
        "one_group_step_ms": round(one, 3),
        "grouped_step_ms": round(grouped, 3),
        "grouped_speedup": round(one / grouped, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--min-prompt-len", type=int, default=192)
    parser.add_argument("--max-prompt-len", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compare-groups",
        action="store_true",
        help="also time each batch with its decode attention in one padded group",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")}, reverse=True)
    prompt_lens = (args.min_prompt_len, args.max_prompt_len)
    block_size = 16
    # Every sequence may grow to the model's length (so no step of the run ends one: the
    # decode steps taken while later prompts prefill count too), and the pool holds the
    # largest batch at that length, so no step preempts.
    max_len = MODEL_CONFIG["max_position_embeddings"]
    max_tokens = max_len - args.max_prompt_len
    num_kv_blocks = batch_sizes[0] * -(-max_len // block_size)
    config = EngineConfig(
        model_dir=str(ensure_model(args.model_dir)),
        dtype=args.dtype,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=batch_sizes[0],
        num_threads=args.threads,
    )
    engine = LLMEngine(config)
    try:
        prefill(engine, batch_sizes[0], prompt_lens, max_tokens, args.seed)
        results = []
        for batch_size in batch_sizes:
            shrink_to(engine, batch_size)
            result = measure(engine, args.warmup_steps, args.steps)
            if args.compare_groups:
                result.update(compare_groups(engine, args.warmup_steps, args.steps))
            print(f"[batch {batch_size}] {json.dumps(result)}", flush=True)
            results.append(result)
    finally:
        engine.shutdown()
    results.reverse()
    target = next((r for r in results if r["batch"] == TARGET_BATCH), None)
    summary = {
        "benchmark": "decode_step",
        "results": results,
        "target": {
            "batch": TARGET_BATCH,
            "max_overhead_share": TARGET_SHARE,
            "met": None if target is None else target["overhead_share"] <= TARGET_SHARE,
        },
        "config": {
            "model": {k: MODEL_CONFIG[k] for k in list(MODEL_CONFIG)[:6]},
            "dtype": args.dtype,
            "threads": args.threads,
            "prompt_lens": prompt_lens,
            "steps": args.steps,
            "max_tokens": max_tokens,
            "warmup_steps": args.warmup_steps,
            "block_size": block_size,
            "num_kv_blocks": num_kv_blocks,
            "seed": args.seed,
        },
    }
    line = json.dumps(summary)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    main()
