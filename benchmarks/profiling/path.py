"""The serving path's costs for `pdserve profile --path`: what a request and a step cost beyond
the engine, measured on a real colocated instance behind the real router, with a real client.

One worker process (pinned, one core) serves batches of B identical requests sent at once through
the router (in this process, as `pdserve bench` runs it) from a client process. CPU time is read
per process before and after each batch, so other work on a shared machine does not
count (to the nanosecond, from each thread's schedstat). From the batches:
  worker_step_ms, worker_seq_ms   the worker's CPU beyond the engine model (the profile's own
                                  fit), per step and per sequence in a step: its loop and the
                                  gRPC stream that carries every step's tokens out
  relay_token_ms, relay_request_ms, relay_step_ms, relay_idle_ms_per_s
                                  router + client CPU per token, per request, per worker step
                                  that emits tokens (one wake-up for all of them: batches sent
                                  at once against spaced ones separate it) and per idle second:
                                  work on the same cores as the workers, taken from them
  path_ttft_ms                    an unloaded request's TTFT beyond the worker's prefill, wall
                                  clock (the hops: client -> router -> worker -> router -> client)
  handoff_ms                      (disaggregated) first token -> first decode step, unloaded, on a
                                  real 1P+1D cluster, less the channel's own time
  kv_send_ms, kv_receive_ms (and _per_token)  (disaggregated) what a request's KV costs the
                                  prefill's and the decode's cores (measure_handoff)
  worker_step_wall_ms             an unloaded request's TPOT beyond the engine step, wall clock:
                                  the step's fixed cost with the loop's waits, which use no CPU
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.latency import StepModel

# (batch, output tokens, seconds between sends): the outputs differ so that per-request and
# per-token costs separate; sends at once put many tokens in each step, spaced sends one or two,
# so that the relay's per-step cost separates from its per-token one.
BATCHES = (
    (1, 64, 0.0),
    (8, 64, 0.0),
    (24, 32, 0.0),
    (8, 2, 0.0),
    (24, 2, 0.0),
    (8, 32, 0.6),
    (16, 8, 0.15),
)
QUICK_BATCHES = ((1, 32, 0.0), (8, 32, 0.0), (8, 2, 0.0), (4, 16, 0.2))  # --quick: a smoke run
STEP_GAP_S = 0.002  # tokens the client receives closer than this came from one worker step


def _cpu_s(pids: list[int]) -> float:
    return sum(_cpu_each(pids))


def _engine_ms(model: StepModel, batch: int, prompt: int, output: int) -> float:
    """The engine model's time for `batch` requests of (prompt, output), alone together."""
    total = model.prefill_stage_ms(batch * prompt, batch * prompt * prompt) - 1
    for step in range(1, output):
        total += model.decode_stage_ms(batch, batch * (prompt + step))
    return total


def measure_path(
    model_dir: str, engine: Any, model: StepModel, log: Any, quick: bool = False
) -> dict[str, float]:
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

        def send(batch: int, tag: str, output: int = output_len, gap: float = 0.0) -> list[Any]:
            prompts = [
                ([rng.randrange(3, vocab) for _ in range(prompt_len)], output) for _ in range(batch)
            ]
            offsets = [index * gap for index in range(batch)]
            return driver.run(address, build_requests(prompts, offsets, tag))

        send(2, f"warm-{time.time():.0f}")
        relay = [*(clock["pid"] for clock in driver.last_clocks), _self_pid()]
        for index in range(3):  # unloaded TTFT, one request at a time
            (record,) = send(1, f"ttft-{index}-{time.time():.0f}")
            ttfts.append(1e3 * ttft(record))
            tpots.append(1e3 * tpot(record))
        began, relay0 = time.perf_counter(), _cpu_s(relay)
        time.sleep(0.5 if quick else 2.0)
        idle_ms_per_s = 1e3 * (_cpu_s(relay) - relay0) / (time.perf_counter() - began)
        for batch, output, gap in QUICK_BATCHES if quick else BATCHES:
            began, worker0, relay0 = time.perf_counter(), _cpu_s(workers), _cpu_s(relay)
            records = send(batch, f"batch-{batch}-{gap}-{time.time():.0f}", output, gap)
            wall = time.perf_counter() - began
            worker_ms = 1e3 * (_cpu_s(workers) - worker0)
            relay_ms = 1e3 * (_cpu_s(relay) - relay0) - idle_ms_per_s * wall
            # sent at once, the batch runs as the engine model's batch; spaced, it does not
            extra = worker_ms - _engine_ms(model, batch, prompt_len, output) if not gap else None
            rows.append(PathRow(batch, output, count_steps(records), extra, relay_ms))
            log(
                f"path: batch {batch} every {gap} s: worker {worker_ms:.0f} ms CPU, "
                f"relay {relay_ms:.0f} ms beyond idle"
            )
    finally:
        driver.close()
        cluster.shutdown()
    prefill_ms = model.prefill_stage_ms(prompt_len, prompt_len**2) - 1
    terms = fit_path(rows, ttfts, prefill_ms)
    terms["relay_idle_ms_per_s"] = idle_ms_per_s
    # A step's fixed cost as latency sees it: an unloaded request's TPOT beyond the engine's
    # step. It holds the worker loop's waits (thread hand-offs), which use no CPU.
    step_wall = statistics.median(tpots) - model.decode_stage_ms(1, prompt_len + output_len // 2)
    terms["worker_step_wall_ms"] = max(step_wall - terms["worker_seq_ms"], 0.0)
    return terms


def measure_handoff(
    model_dir: str,
    model: StepModel,
    worker_terms: dict[str, float],
    log: Any,
    quick: bool = False,
) -> dict[str, float]:
    """The KV hand-off on a real 1 prefill + 1 decode cluster, one request at a time:
      handoff_ms        from a request's first token to its first decode step, unloaded (the
                        breakdown's transfer and decode queue: the reservation, the dial, the
                        landing noticed by the decode loop), channel included
      kv_send_ms[_per_token]     the prefill worker's CPU per request beyond its engine step
                                 (gathering the KV, the socket writes, the hand-off's messages)
      kv_receive_ms[_per_token]  the decode worker's CPU per request beyond its one decode step
                                 (the socket reads into the cache, the reservation, the landing)
    Each worker's idle CPU over the same wall time (its loop's waits, load reports) is taken
    out; per request and per token are fitted over prompts of HANDOFF_LENS tokens."""
    from benchmarks.goodput.driver import LoadDriver
    from benchmarks.goodput.layouts import cluster_spec, start_local_cluster
    from benchmarks.goodput.workloads import build_requests
    from planner.metrics import breakdown

    cluster = start_local_cluster(cluster_spec("disaggregated", model_dir, pin_cpus=True))
    driver = LoadDriver(num_processes=1)
    rng, vocab, waits = random.Random(1), engine_vocab(model_dir), []
    rows: list[tuple[int, float, float]] = []  # (prompt tokens, send ms, receive ms)
    step_ms = worker_terms.get("worker_step_ms", 0.0) + worker_terms.get("worker_seq_ms", 0.0)
    try:
        pids = {name: worker.pid for name, worker in cluster.workers.items()}
        prefill_pid, decode_pid = pids["prefill-0"], pids["decode-0"]

        def one(length: int, tag: str) -> Any:
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            (record,) = driver.run(cluster.address, build_requests([(prompt, 2)], [0.0], tag))
            return record

        one(64, f"handoff-warm-{time.time():.0f}")  # dials the channel
        idle = _idle_cpu_per_s([prefill_pid, decode_pid], seconds=0.5 if quick else 3.0)
        for length in HANDOFF_LENS:
            for index in range(1 if quick else HANDOFF_REPEATS):
                began, cpu0 = time.perf_counter(), _cpu_each([prefill_pid, decode_pid])
                record = one(length, f"handoff-{length}-{index}-{time.time():.0f}")
                wall = time.perf_counter() - began
                sent, received = (
                    1e3 * (after - before - rate * wall)
                    for after, before, rate in zip(
                        _cpu_each([prefill_pid, decode_pid]), cpu0, idle, strict=True
                    )
                )
                engine_prefill = model.prefill_stage_ms(length, length * length) - 1
                engine_step = model.decode_stage_ms(1, length + 1)
                rows.append(
                    (length, sent - engine_prefill - step_ms, received - engine_step - step_ms)
                )
                parts = breakdown(record)
                waits.append(1e3 * (parts["transfer"] + parts["decode_queue"]))
    finally:
        driver.close()
        cluster.shutdown()
    terms = fit_handoff(rows)
    terms["handoff_ms"] = statistics.median(waits)
    log("path: KV hand-off " + ", ".join(f"{k} {v:.3f}" for k, v in terms.items()))
    return terms


HANDOFF_LENS = (64, 256, 512)
HANDOFF_REPEATS = 6


def fit_handoff(rows: list[tuple[int, float, float]]) -> dict[str, float]:
    """Least squares of (prompt tokens, send ms, receive ms) rows: ms = per request + per token
    * tokens, for each end (negative fits clipped to 0: no such cost measured)."""
    tokens = np.array([float(row[0]) for row in rows])
    design = np.stack([np.ones_like(tokens), tokens], 1)
    out = {}
    for name, column in (("kv_send", 1), ("kv_receive", 2)):
        (per_request, per_token), *_ = np.linalg.lstsq(
            design, np.array([row[column] for row in rows]), rcond=None
        )
        out[f"{name}_ms"] = float(max(per_request, 0.0))
        out[f"{name}_ms_per_token"] = float(max(per_token, 0.0))
    return out


def _cpu_each(pids: list[int]) -> list[float]:
    """Each process's CPU seconds, to the nanosecond where Linux's schedstat is there (the
    tick-based counters move in 10 ms steps, a request's whole cost here)."""
    return [_schedstat_s(pid) for pid in pids]


def _schedstat_s(pid: int) -> float:
    import os

    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as handle:
                    total += int(handle.read().split()[0])
            except (OSError, ValueError, IndexError):  # the thread ended: its time is lost
                continue
    except OSError:  # no /proc: the tick-based counters
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    return total / 1e9


def _idle_cpu_per_s(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU seconds per second while nothing is sent."""
    began, before = time.perf_counter(), _cpu_each(pids)
    time.sleep(seconds)
    wall = time.perf_counter() - began
    return [(after - cpu) / wall for after, cpu in zip(_cpu_each(pids), before, strict=True)]


@dataclass(frozen=True)
class PathRow:
    """One batch: B requests of O tokens, the worker steps that emitted them, the worker's CPU
    beyond the engine model (None: not comparable, the sends were spaced) and the relay's."""

    batch: int
    output: int
    steps: int
    worker_extra_ms: float | None
    relay_ms: float


def count_steps(records: list[Any]) -> int:
    """Worker steps that emitted tokens, as the client saw them: arrivals closer than
    STEP_GAP_S (one step's tokens, relayed one after another) count once."""
    times = sorted(t for record in records for t in record.token_times)
    return sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > STEP_GAP_S)


def fit_path(rows: list[PathRow], ttfts_ms: list[float], prefill_ms: float) -> dict[str, float]:
    """Least squares over the batches: extra worker CPU = O steps * step + B*O tokens * seq
    (batches sent at once); relay CPU = B * request + S emitting steps * step + B*O * token."""
    together = [row for row in rows if row.worker_extra_ms is not None]
    steps = np.array([float(row.output) for row in together])
    tokens = np.array([float(row.batch * row.output) for row in together])
    worker = np.array([row.worker_extra_ms for row in together], dtype=float)
    (step_ms, seq_ms), *_ = np.linalg.lstsq(np.stack([steps, tokens], 1), worker, rcond=None)
    design = np.array([[row.batch, row.steps, row.batch * row.output] for row in rows], float)
    relay = np.array([row.relay_ms for row in rows])
    (req_ms, relay_step_ms, tok_ms), *_ = np.linalg.lstsq(design, relay, rcond=None)
    return {
        "worker_step_ms": float(max(step_ms, 0.0)),
        "worker_seq_ms": float(max(seq_ms, 0.0)),
        "relay_request_ms": float(max(req_ms, 0.0)),
        "relay_token_ms": float(max(tok_ms, 0.0)),
        "relay_step_ms": float(max(relay_step_ms, 0.0)),
        "path_ttft_ms": float(max(statistics.median(ttfts_ms) - prefill_ms, 0.0)),
    }


def engine_vocab(model_dir: str) -> int:
    from engine.model_config import ModelConfig

    return ModelConfig.from_model_dir(model_dir).vocab_size


def _self_pid() -> int:
    import os

    return os.getpid()
