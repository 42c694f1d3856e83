"""The engine's own steps against vLLM's, offline, on SmolLM2-135M-Instruct in float32: where a
served request's time goes before any server is involved.

    python -m benchmarks.vs_vllm_engine [--vllm-python PATH] [--out PATH]

Each case runs in a process of its own, pinned to its cores: pdserve's LLM with one torch thread
on core 0 and with two on cores 0-1, each with its linear layers packed for oneDNN (the default)
and with F.linear (`packed_linears=False`); vLLM's offline LLM on cores 0-1
(VLLM_CPU_OMP_THREADS_BIND), prefix caching off on both. Per case (median ms of a few repeats):
  prefill_256_ms, prefill_512_ms   one prompt of that length, to its first token
  decode_b{1,4,8}_ms               one decode step of B sequences at contexts of 256-290 tokens:
                                   (B prompts x 33 tokens - B prompts x 1 token) / 32
The last line holds every case and pdserve's ratios to vLLM (vLLM's time over pdserve's, so
above 1 means pdserve is faster). Without vLLM at --vllm-python, vLLM's case is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.output import emit
from benchmarks.vs_vllm import vllm_missing
from benchmarks.vs_vllm_servers import OFFLINE_ENV, REPO

PROMPT_LENS = (256, 512)
BATCHES = (1, 4, 8)
DECODE_TOKENS = 32
REPEATS = 3

# One case: the engine under test as `make(model_dir, threads)`, `generate(prompts, max_tokens)`.
CASE = r"""
import json, random, statistics, sys, time
kind, model_dir, threads, packed = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
if kind == "vllm":
    from vllm import LLM, SamplingParams
    def main():
        llm = LLM(model=model_dir, dtype="float32", max_model_len=2048,
                  enable_prefix_caching=False)
        def generate(prompts, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        measure(generate)
else:
    import torch
    torch.set_num_threads(threads)
    from engine import LLM, SamplingParams
    def main():
        llm = LLM(model_dir, enable_prefix_caching=False, num_threads=threads,
                  packed_linears=packed)
        def generate(prompts, max_tokens):
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        measure(generate)

def measure(generate):
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, 40000) for _ in range(n)]
    generate([prompt(64)], 2)  # warm-up
    out = {}
    for length in PROMPT_LENS:
        times = []
        for _ in range(REPEATS):
            began = time.perf_counter()
            generate([prompt(length)], 1)
            times.append(time.perf_counter() - began)
        out[f"prefill_{length}_ms"] = 1e3 * statistics.median(times)
    for batch in BATCHES:
        steps = []
        for _ in range(REPEATS):
            began = time.perf_counter()
            generate([prompt(256) for _ in range(batch)], 1)
            prefill = time.perf_counter() - began
            began = time.perf_counter()
            generate([prompt(256) for _ in range(batch)], DECODE_TOKENS + 1)
            steps.append((time.perf_counter() - began - prefill) / DECODE_TOKENS)
        out[f"decode_b{batch}_ms"] = 1e3 * statistics.median(steps)
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def run_case(python: str, kind: str, model_dir: Path, threads: int, packed: bool) -> dict:
    constants = (
        f"PROMPT_LENS = {PROMPT_LENS}\nBATCHES = {BATCHES}\n"
        f"DECODE_TOKENS = {DECODE_TOKENS}\nREPEATS = {REPEATS}\n"
    )
    cores = ",".join(str(core) for core in range(threads))
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")]),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    command = ["taskset", "-c", cores, python, "-c", constants + CASE]
    command += [kind, str(model_dir), str(threads), "1" if packed else "0"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} case exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=sys.executable, help="the vLLM venv's python")
    parser.add_argument("--out", default=None, help="also write the last line's JSON here")
    args = parser.parse_args(argv)
    from deploy.config.models import smollm2_dir

    model_dir = smollm2_dir(say=print)
    cases: dict[str, dict[str, Any]] = {}
    for threads in (1, 2):
        for packed in (True, False):
            name = f"pdserve_{threads}t_{'onednn' if packed else 'f_linear'}"
            cases[name] = run_case(sys.executable, "pdserve", model_dir, threads, packed)
            print(json.dumps({name: cases[name]}), flush=True)
    missing = vllm_missing(args.vllm_python)
    if missing is None:
        cases["vllm_2t"] = run_case(args.vllm_python, "vllm", model_dir, 2, True)
        print(json.dumps({"vllm_2t": cases["vllm_2t"]}), flush=True)
    else:
        print(f"vLLM left out: {missing}", file=sys.stderr)
    result: dict[str, Any] = {"benchmark": "vs_vllm_engine", "model": model_dir.name}
    if "vllm_2t" in cases:
        mine = cases["pdserve_2t_onednn"]
        result["vllm_over_pdserve_2t"] = {
            key: cases["vllm_2t"][key] / mine[key] for key in mine if mine[key] > 0
        }
    result["cases"] = cases
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
