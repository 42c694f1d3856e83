"""The serving path's costs for `pdserve profile --path`: what a request and a step cost beyond
the engine, measured on a real colocated instance behind the real router, with a real client.

One worker process (pinned, one core) serves batches of B identical requests sent at once through
the router (in this process, as `pdserve bench` runs it) from a client process. CPU time is read
per process with psutil before and after each batch, so other work on a shared machine does not
count. From the batches:
  worker_step_ms, worker_seq_ms   the worker's CPU beyond the engine model (the profile's own
                                  fit), per step and per sequence in a step: its loop and the
                                  gRPC stream that carries every step's tokens out
  relay_token_ms, relay_request_ms  router + client CPU per token and per request: work on the
                                  same cores as the workers, taken from them under load
  path_ttft_ms                    an unloaded request's TTFT beyond the worker's prefill, wall
                                  clock (the hops: client -> router -> worker -> router -> client)
  handoff_ms                      (disaggregated) first token -> first decode step, unloaded, on a
                                  real 1P+1D cluster, less the channel's own time
  worker_step_wall_ms             an unloaded request's TPOT beyond the engine step, wall clock:
                                  the step's fixed cost with the loop's waits, which use no CPU
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

import numpy as np

from planner.latency import StepModel

# (batch, output tokens): the outputs differ so that per-request and per-token costs separate
BATCHES = ((1, 64), (8, 64), (24, 32))


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _engine_ms(model: StepModel, batch: int, prompt: int, output: int) -> float:
    """The engine model's time for `batch` requests of (prompt, output), alone together."""
    total = model.prefill_stage_ms(batch * prompt, batch * prompt * prompt) - 1
    for step in range(1, output):
        total += model.decode_stage_ms(batch, batch * (prompt + step))
    return total


def measure_path(model_dir: str, engine: Any, model: StepModel, log: Any) -> dict[str, float]:
    from benchmarks.goodput.driver import LoadDriver
    from benchmarks.goodput.layouts import cluster_spec, start_local_cluster
    from benchmarks.goodput.workloads import build_requests
    from planner.metrics import tpot, ttft
    from worker.config import WorkerConfig

    spec = cluster_spec("colocated", model_dir, pin_cpus=True)
    spec = dataclasses.replace(spec, colocated=WorkerConfig(engine), num_colocated_instances=1)
    cluster = start_local_cluster(spec)
    driver = LoadDriver(num_processes=1)
    rng, prompt_len, output_len = random.Random(0), 64, 64  # TTFT runs: output_len
    vocab = engine_vocab(model_dir)
    rows, ttfts, tpots = [], [], []
    try:
        address, workers = cluster.address, cluster.process_ids()

        def send(batch: int, tag: str, output: int = output_len) -> list[Any]:
            prompts = [([rng.randrange(3, vocab) for _ in range(prompt_len)], output)
                       for _ in range(batch)]  # fmt: skip
            return driver.run(address, build_requests(prompts, [0.0] * batch, tag))

        send(2, f"warm-{time.time():.0f}")
        client = [clock["pid"] for clock in driver.last_clocks]
        for index in range(3):  # unloaded TTFT, one request at a time
            (record,) = send(1, f"ttft-{index}-{time.time():.0f}")
            ttfts.append(1e3 * ttft(record))
            tpots.append(1e3 * tpot(record))
        for batch, output in BATCHES:
            worker0, relay0 = _cpu_s(workers), _cpu_s([*client, _self_pid()])
            send(batch, f"batch-{batch}-{time.time():.0f}", output)
            worker_ms = 1e3 * (_cpu_s(workers) - worker0)
            relay_ms = 1e3 * (_cpu_s([*client, _self_pid()]) - relay0)
            extra = worker_ms - _engine_ms(model, batch, prompt_len, output)
            rows.append((batch, output, extra, relay_ms))
            log(f"path: batch {batch}: worker {worker_ms:.0f} ms CPU, relay {relay_ms:.0f} ms")
    finally:
        driver.close()
        cluster.shutdown()
    prefill_ms = model.prefill_stage_ms(prompt_len, prompt_len**2) - 1
    terms = fit_path(rows, ttfts, prefill_ms)
    # A step's fixed cost as latency sees it: an unloaded request's TPOT beyond the engine's
    # step. It holds the worker loop's waits (thread hand-offs), which use no CPU.
    step_wall = statistics.median(tpots) - model.decode_stage_ms(1, prompt_len + output_len // 2)
    terms["worker_step_wall_ms"] = max(step_wall - terms["worker_seq_ms"], 0.0)
    return terms


def measure_handoff(model_dir: str, log: Any) -> float:
    """The KV hand-off's latency beyond the channel, unloaded: on a real 1 prefill + 1 decode
    cluster, from a request's first token to its first decode step (the breakdown's transfer
    and decode queue: the reservation, the dial, the landing noticed by the decode loop)."""
    from benchmarks.goodput.driver import LoadDriver
    from benchmarks.goodput.layouts import cluster_spec, start_local_cluster
    from benchmarks.goodput.workloads import build_requests
    from planner.metrics import breakdown

    cluster = start_local_cluster(cluster_spec("disaggregated", model_dir, pin_cpus=True))
    driver = LoadDriver(num_processes=1)
    rng, vocab, waits = random.Random(1), engine_vocab(model_dir), []
    try:
        for index in range(5):  # the first warms the channel up
            prompt = [rng.randrange(3, vocab) for _ in range(64)]
            tag = f"handoff-{index}-{time.time():.0f}"
            (record,) = driver.run(cluster.address, build_requests([(prompt, 8)], [0.0], tag))
            parts = breakdown(record)
            if index:
                waits.append(1e3 * (parts["transfer"] + parts["decode_queue"]))
    finally:
        driver.close()
        cluster.shutdown()
    log(f"path: KV hand-off {statistics.median(waits):.1f} ms from first token to decode")
    return statistics.median(waits)


def fit_path(
    rows: list[tuple[int, int, float, float]], ttfts_ms: list[float], prefill_ms: float
) -> dict[str, float]:
    """Least squares over (batch B, output O, extra worker CPU, relay CPU) rows: extra worker
    CPU = O steps * step + B*O tokens * seq; relay CPU = B requests * request + B*O * token."""
    batch = np.array([float(row[0]) for row in rows])
    steps = np.array([float(row[1]) for row in rows])
    tokens = batch * steps
    worker = np.array([row[2] for row in rows])
    relay = np.array([row[3] for row in rows])
    (step_ms, seq_ms), *_ = np.linalg.lstsq(np.stack([steps, tokens], 1), worker, rcond=None)
    (req_ms, tok_ms), *_ = np.linalg.lstsq(np.stack([batch, tokens], 1), relay, rcond=None)
    return {
        "worker_step_ms": float(max(step_ms, 0.0)), "worker_seq_ms": float(max(seq_ms, 0.0)),
        "relay_request_ms": float(max(req_ms, 0.0)), "relay_token_ms": float(max(tok_ms, 0.0)),
        "path_ttft_ms": float(max(statistics.median(ttfts_ms) - prefill_ms, 0.0)),
    }  # fmt: skip


def engine_vocab(model_dir: str) -> int:
    from engine.model_config import ModelConfig

    return ModelConfig.from_model_dir(model_dir).vocab_size


def _self_pid() -> int:
    import os

    return os.getpid()
