"""`pdserve profile`: this deployment's latency model, measured with the real engine and fitted.

For each TP size asked for, one LLMEngine with the serve config's engine settings (prefix cache
off, so a repeated prompt is computed again) runs on one torch thread per rank, as a pinned worker
does. Each figure is the median of a few repeats, after a warm-up: the step a server sees is the
typical one (the least of eight decode steps ran 3-5% under their median here), and the fit
leaves out a disturbed point (planner/fit.py). On CPU at TP=1 the clock is the process's CPU
time: a pinned worker owns its core, so CPU time is what its step takes there, even while other
work shares this machine (`--clock wall` for wall time):
  prefill   a batch of B prompts of length L, from queueing to every first token (all the
            engine's chunked steps): a + b*Σl + c*Σl²
  decode    one step of B running sequences with context C (the largest batch is prefilled once
            and shrunk by aborts, as benchmarks/decode_step.py does): a + b*Σ(ctx+1) + c*B,
            and the constant part at each B to BY_BATCH_MAX (decode_by_batch)
  mixed     each chunked step of a prompt beside B running decodes (a colocated step): its
            time beyond the decodes' part, a' + b'*Σm + c'*Σ(m² + 2mp) (chunked_prefill)
  transfer  one request's KV from a prefill rank process to a decode rank process over the real
            kv_transfer channel (benchmarks/profiling/transfer.py): per-message ms + bytes / bandwidth
  path      (--path) the serving path around a TP=1 engine: benchmarks/profiling/path.py
planner/fit.py fits them; the file has DistServe's shape plus our keys (planner/profile.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.fit import fit_decode, fit_decode_by_batch, fit_mixed, fit_prefill
from planner.profile import ModelProfile, TPProfile, save_profiles


@dataclass(frozen=True)
class Grid:
    """What to measure. `quick` is a small grid that runs in about a minute on one core."""

    prefill_lens: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    transfer_tokens: tuple[int, ...]
    repeats: int
    decode_steps: int
    # mixed steps: a prompt of each length beside a running batch at a context (colocated)
    mixed_batches: tuple[int, ...] = (4, 16)
    mixed_contexts: tuple[int, ...] = (128, 512)
    mixed_lens: tuple[int, ...] = (64, 256, 512, 768)

    def __post_init__(self) -> None:
        if min(self.repeats, self.decode_steps) < 1:
            raise ValueError("repeats and decode_steps must be >= 1")


# Decode at every batch size to BY_BATCH_MAX: the step is not linear there (TPProfile's
# decode_by_batch), and a grid of 1, 4, 8, 16 alone hits only the cheap ones; past it, sizes
# off the multiples of four too, so that the triple runs through the middle of the sawtooth.
BY_BATCH_MAX = 16
QUICK = Grid((32, 128, 384, 768), (1, 2, 4), (64, 384), (1, 2, 3, 8, 32), (64, 512, 2048), 2, 4)
FULL = Grid(
    (16, 64, 128, 256, 512, 768, 1024),
    (1, 2, 4, 8),
    (32, 128, 384, 768),
    (*range(1, BY_BATCH_MAX + 1), 20, 23, 26, 29, 32, 48, 64),
    (64, 256, 1024, 4096),
    3,
    8,
)


def _params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


class EngineProbe:
    """One engine and random prompts; each method returns measured times in ms."""

    def __init__(self, config: Any, clock: Any = time.perf_counter) -> None:
        from engine.llm import LLMEngine

        self.engine = LLMEngine(config)
        self.vocab = self.engine.executor.model_config.vocab_size
        self.max_len = self.engine.max_model_len
        self.rng = random.Random(0)
        self.count = 0
        self.clock = clock

    def _add(self, length: int, max_tokens: int) -> str:
        self.count += 1
        rid = f"profile-{self.count}"
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(length)]
        self.engine.add_request(rid, prompt, _params(max_tokens))
        return rid

    def prefill_ms(self, lens: Sequence[int]) -> float:
        """Queue the prompts, step until each has its first token; abort them."""
        rids = [self._add(n, 2) for n in lens]
        started, pending = self.clock(), set(rids)
        while pending:
            for out in self.engine.step():
                if out.new_token_ids:
                    pending.discard(out.request_id)
        elapsed = (self.clock() - started) * 1e3
        for rid in rids:
            self.engine.abort(rid)
        self.engine.step()  # reports the aborts; frees the blocks
        return elapsed

    def decode_ms(
        self, context: int, batches: Sequence[int], steps: int
    ) -> list[tuple[int, int, float]]:
        """(B, Σctx, ms per step) for each batch size, from one prefill of the largest."""
        rids = self._start_decodes(context, max(batches), (steps + 2) * len(batches) + 8)
        scheduler = self.engine.scheduler
        samples = []
        for batch in sorted(batches, reverse=True):
            for request in list(scheduler.running[batch:]):
                self.engine.abort(request.request_id)
            self.engine.step()
            times = []
            for _ in range(steps):
                sum_ctx = sum(r.num_tokens - 1 for r in scheduler.running)
                began = self.clock()
                self.engine.step()
                times.append(((self.clock() - began) * 1e3, sum_ctx))
            middle = round(statistics.median(ctx for _, ctx in times))
            samples.append(
                (len(scheduler.running), middle, statistics.median(ms for ms, _ in times))
            )
        for rid in rids:
            self.engine.abort(rid)
        self.engine.step()
        return samples

    def mixed_ms(
        self, context: int, batch: int, lens: Sequence[int], repeats: int
    ) -> list[tuple[int, int, int, int, float]]:
        """(B, Σctx, m, m² + 2mp, ms) of each step that computes a chunk of m prompt tokens
        (after p computed ones) beside `batch` running decodes: a prompt of each length is
        queued, its chunked steps timed, then it is aborted. The median of `repeats` per step."""
        steps_needed = len(lens) * repeats * 4 + 8
        rids = set(self._start_decodes(context, batch, steps_needed))
        scheduler = self.engine.scheduler
        runs: dict[tuple[int, int], list[tuple[int, int, int, int, float]]] = {}
        for length in lens:
            for _ in range(repeats):
                rid, computed, index = self._add(length, 2), 0, 0
                while computed < length:
                    sum_ctx = sum(
                        r.num_tokens - 1 for r in scheduler.running if r.request_id in rids
                    )
                    began = self.clock()
                    self.engine.step()
                    elapsed = (self.clock() - began) * 1e3
                    now = scheduler.requests[rid].num_computed_tokens
                    chunk, key = now - computed, (length, index)
                    sample = (batch, sum_ctx, chunk, chunk * chunk + 2 * chunk * computed, elapsed)
                    runs.setdefault(key, []).append(sample)
                    computed, index = now, index + 1
                self.engine.abort(rid)
                self.engine.step()
        for rid in rids:
            self.engine.abort(rid)
        self.engine.step()
        return [sorted(found, key=lambda s: s[-1])[len(found) // 2] for found in runs.values()]

    def _start_decodes(self, context: int, batch: int, max_tokens: int) -> list[str]:
        """`batch` requests of `context` prompt tokens, prefilled and decoding."""
        rids = [self._add(context, min(max_tokens, self.max_len - context)) for _ in range(batch)]
        scheduler = self.engine.scheduler
        while scheduler.waiting or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running
        ):
            self.engine.step()
        return rids

    def shutdown(self) -> None:
        self.engine.shutdown()


def measure_prefill(probe: EngineProbe, grid: Grid, budget: int) -> list[tuple[list[int], float]]:
    samples = []
    probe.prefill_ms([grid.prefill_lens[0]])  # warm-up
    for length in grid.prefill_lens:
        for batch in grid.prefill_batches:
            if length * batch > budget or length >= probe.max_len:
                continue
            lens = [length] * batch
            times = [probe.prefill_ms(lens) for _ in range(grid.repeats)]
            samples.append((lens, statistics.median(times)))
    return samples


def measure_decode(probe: EngineProbe, grid: Grid) -> list[tuple[int, int, float]]:
    samples: list[tuple[int, int, float]] = []
    for context in grid.decode_contexts:
        if context + 16 >= probe.max_len:
            continue
        samples += probe.decode_ms(context, grid.decode_batches, grid.decode_steps)
    return samples


def measure_mixed(probe: EngineProbe, grid: Grid) -> list[tuple[int, int, int, int, float]]:
    samples: list[tuple[int, int, int, int, float]] = []
    for context in grid.mixed_contexts:
        lens = [n for n in grid.mixed_lens if context + n + 16 < probe.max_len]
        if not lens or context + 64 >= probe.max_len:
            continue
        for batch in grid.mixed_batches:
            samples += probe.mixed_ms(context, batch, lens, grid.repeats)
    return samples


def pick_clock(name: str, config: Any) -> Any:
    """CPU time for one CPU rank in this process (see the module docstring), else wall time."""
    if name not in ("auto", "cpu", "wall"):
        raise ValueError(f"--clock must be auto, cpu or wall, got {name!r}")
    if name == "auto":
        name = "cpu" if config.device == "cpu" and config.tensor_parallel_size == 1 else "wall"
    return time.process_time if name == "cpu" else time.perf_counter


def profile_tp(
    config: Any, grid: Grid, log: Any, clock: str = "auto"
) -> tuple[TPProfile, dict[str, Any]]:
    """Measure and fit one TP size; returns the profile entry and the raw samples."""
    import torch

    from engine.kv_cache import KVCacheSpec

    torch.set_num_threads(1)
    probe = EngineProbe(config, pick_clock(clock, config))
    try:
        started = time.perf_counter()
        prefill = measure_prefill(probe, grid, config.max_num_batched_tokens)
        log(
            f"tp={config.tensor_parallel_size}: {len(prefill)} prefill points "
            f"({time.perf_counter() - started:.0f} s)"
        )
        decode = measure_decode(probe, grid)
        log(
            f"tp={config.tensor_parallel_size}: {len(decode)} decode points "
            f"({time.perf_counter() - started:.0f} s)"
        )
        mixed = measure_mixed(probe, grid)
        log(
            f"tp={config.tensor_parallel_size}: {len(mixed)} mixed-step points "
            f"({time.perf_counter() - started:.0f} s)"
        )
        model = probe.engine.executor.model_config
        block_size = probe.engine.executor.block_size
        blocks = probe.engine.executor.num_kv_blocks * block_size
    finally:
        probe.shutdown()
    small, large = fit_decode(decode)
    by_batch = fit_decode_by_batch(decode, small, BY_BATCH_MAX)
    chunked = fit_mixed(mixed, small) if len(mixed) >= 3 else None
    # the whole model's KV per token as the pool stores it (kv_cache.dtype: 8 bits and scales)
    kv_bytes = (
        KVCacheSpec(
            model.num_layers,
            1,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            getattr(torch, config.dtype),
            config.kv_cache_dtype,
        ).bytes_per_block
        / block_size
    )
    entry = TPProfile(
        prefill=fit_prefill(prefill),
        decode_small=small,
        decode_large=large,
        kv_bytes_per_token=float(kv_bytes),
        # every layer slides: a decoding request keeps (W - 1) // block_size + 2 blocks at most
        kv_window_tokens=(
            None
            if model.release_window is None
            else ((model.release_window - 1) // block_size + 2) * block_size
        ),
        max_num_tokens={1: blocks},
        overhead=(0.0, 0.0),
        chunked_prefill=chunked,
        decode_by_batch=by_batch,
    )
    raw = {
        "prefill": [[lens, ms] for lens, ms in prefill],
        "decode": [list(s) for s in decode],
        "mixed": [list(s) for s in mixed],
    }
    return entry, raw


def run_profile(args: argparse.Namespace) -> int:
    """The `pdserve profile` handler (benchmarks/profiling/cli.py parses the flags)."""
    configs, model_name = engine_configs(args)
    grid = QUICK if args.quick else FULL
    profiles, raw = {}, {}

    def log(line: str) -> None:
        print(f"pdserve profile: {line}", file=sys.stderr, flush=True)

    for tp, config in configs.items():
        entry, raw[str(tp)] = profile_tp(config, grid, log, getattr(args, "clock", "auto"))
        if not getattr(args, "no_transfer", False):
            from benchmarks.profiling.transfer import measure_transfer

            bandwidth, per_message, points = measure_transfer(config, tp, grid, log)
            entry = replace(entry, transfer_GBps=bandwidth, transfer_per_message_ms=per_message)
            raw[str(tp)]["transfer"] = points
        if getattr(args, "path", False) and tp == 1:
            from benchmarks.profiling.path import measure_handoff, measure_path
            from planner.latency import StepModel

            terms = measure_path(config.model_dir, config, StepModel(entry), log, args.quick)
            channel = 0.0
            if entry.transfer_GBps and entry.kv_bytes_per_token:  # 64 tokens over the channel
                channel = entry.transfer_per_message_ms + 64 * entry.kv_bytes_per_token / (
                    entry.transfer_GBps * 1e6
                )
            handoff = measure_handoff(config.model_dir, StepModel(entry), terms, log, args.quick)
            handoff["handoff_ms"] = max(handoff["handoff_ms"] - channel, 0.0)
            terms.update(handoff)
            entry = replace(entry, serving_path=terms)
            log("serving path: " + ", ".join(f"{k} {v:.3f}" for k, v in terms.items()))
        profiles[tp] = entry
    save_profiles(args.out, {model_name: ModelProfile(model_name, profiles)})
    if getattr(args, "raw_out", None):
        Path(args.raw_out).write_text(json.dumps(raw) + "\n", encoding="utf-8")
    print(json.dumps({"profile": args.out, "tp": sorted(profiles), "model": model_name}))
    return 0


def engine_configs(args: argparse.Namespace) -> tuple[dict[int, Any], str]:
    """One EngineConfig per TP size from the serve config (or the goodput benchmark's model)."""
    from deploy.config.cluster_spec import engine_config
    from deploy.config.models import resolve_model
    from deploy.config.serve_config import ServeConfig, load_config

    tps = sorted({int(t) for t in str(args.tp).split(",")})
    if getattr(args, "bench_model", None):
        from benchmarks.goodput.layouts import engine_config as bench_config
        from benchmarks.goodput.layouts import ensure_bench_model

        model_dir = str(ensure_bench_model(args.bench_model))
        return {t: bench_config(model_dir, tensor_parallel_size=t) for t in tps}, model_dir
    serve = load_config(args.config) if args.config else ServeConfig()
    model_dir = resolve_model(serve.model)
    configs = {
        t: replace(engine_config(serve, model_dir, t), enable_prefix_caching=False) for t in tps
    }
    return configs, serve.model
