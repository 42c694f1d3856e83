"""This machine's unloaded latencies, which the synthetic shapes' SLOs are multiples of.

`calibrate_via_router` (the default, through the colocated baseline's router before its sweep,
or through the first --target): requests sent one at a time through the whole serving path.
`calibrate` (--calibrate engine): one LLMEngine in this process on one thread (a worker's core,
without the cluster around it), which leaves out gRPC, the router and the process hop, so SLOs
of a few times its figures can be tighter than the path allows even unloaded:
  prefill_s      a prompt of the workload's 90th-percentile length (compare.slo_base_prompt_len),
                 alone: the best TTFT such a prompt can have
  decode_step_s  one decode step of a single sequence with that context: the best TPOT possible
Each is the median of a few repetitions, after a warm-up.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Calibration:
    prompt_len: int
    prefill_s: float
    decode_step_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(
    engine_config: Any, prompt_len: int, token_id_range: tuple[int, int], repeats: int = 3
) -> Calibration:
    import torch

    from engine.llm import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    rng = random.Random(0)
    engine = LLMEngine(engine_config)
    prefill_times, step_times = [], []
    try:
        for index in range(repeats + 1):  # the first round warms up and is not counted
            prompt = [rng.randrange(*token_id_range) for _ in range(prompt_len)]
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            engine.add_request(f"calibrate-{index}", prompt, params)
            began = time.perf_counter()
            while not any(output.new_token_ids for output in engine.step()):
                pass  # a prompt longer than chunk_size takes several steps
            prefill_s = time.perf_counter() - began
            steps = []
            while engine.has_unfinished():
                began = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - began)
            if index > 0:
                prefill_times.append(prefill_s)
                step_times.append(statistics.median(steps))
    finally:
        engine.shutdown()
    return Calibration(prompt_len, statistics.median(prefill_times), statistics.median(step_times))


def calibrate_via_router(
    driver: Any, address: str, prompt_len: int, token_id_range: tuple[int, int], repeats: int = 3
) -> Calibration:
    """The same two figures measured through a running router (a remote cluster, `--target`):
    median TTFT and TPOT of `repeats` requests sent one at a time, after one warm-up."""
    from benchmarks.goodput.workloads import build_requests
    from planner.metrics import tpot, ttft

    rng = random.Random(0)
    first_tokens, per_tokens = [], []
    for index in range(repeats + 1):
        prompt = [rng.randrange(*token_id_range) for _ in range(prompt_len)]
        requests = build_requests([(prompt, 8)], [0.0], f"calibrate-{index}-{time.time():.0f}")
        (record,) = driver.run(address, requests)
        if not record.ok:
            raise RuntimeError(f"calibration request failed: {record.error}")
        if index > 0:
            first_tokens.append(ttft(record))
            per_tokens.append(tpot(record))
    return Calibration(prompt_len, statistics.median(first_tokens), statistics.median(per_tokens))
