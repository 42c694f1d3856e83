"""Structured output through a served cluster on SmolLM2: does every answer validate, and what
does the grammar cost?

    python -m benchmarks.structured_output [--schemas 200] [--layout disaggregated]
        [--sampling] [--batch 16] [--any-whitespace] [--out PATH]

Layouts: `disaggregated` (1 prefill + 1 decode instance), `disaggregated-tp3` (the prefill
instance at TP 3: SmolLM2's 9 heads do not split over 2), `colocated`; plain processes on 127.0.0.1, float32. The suite is benchmarks/structured_schemas.py.
Each schema goes in a chat request (gRPC, the schema in the prompt and as `json_schema`), `--batch`
at a time, greedy (or `--sampling`: temperature 0.8, top-p 0.95, a seed per request); every
answer is parsed and validated with `jsonschema` (formats checked). JSON is compact unless
`--any-whitespace` (vLLM's disable_any_whitespace, the default here: a 135M model given free
whitespace sometimes spends its tokens on it).

The JSON's figures:
- `valid_fraction`: answers that parse and validate, over `schemas`;
- `tpot_overhead_b16`: mean TPOT of `--batch` concurrent constrained requests over the same
  prompts unconstrained, generating as many tokens each (ignore_eos, max_tokens = the
  constrained answer's length), their prompts cached first, `--tpot-rounds` rounds, each way
  first in every other; the router's own timings. Colocated, a request's TPOT includes the
  prefills that arrive while it decodes, which the arrival order decides: one round's ratio
  spreads by 0.2 either way, grammar or not (`tpot_overhead_rounds`);
- `itl_overhead_b16`: the same rounds token-weighted (decode time over decode tokens, vLLM's
  mean ITL), which a short request's span does not dominate;
- `first_token_ms_overhead`: the median paired TTFT difference, one request at a time, of a
  constrained request over the same prompt unconstrained, with the grammar and the prompt's
  blocks already cached (so the difference is the grammar's: the check, the mask, the matcher);
- `compile_ms_p50` / `p99`: compiling each schema cold against the model's tokenizer (what the
  router does the first time it sees a spec; each worker does it again, off its step loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from benchmarks.output import emit
from benchmarks.structured_schemas import schemas

LAYOUTS: dict[str, dict[str, Any]] = {
    "disaggregated": {},
    # SmolLM2's 9 heads split over 1 or 3 ranks, not 2 (TP 2 runs on the tiny models of
    # tests/router/test_structured_cluster.py)
    "disaggregated-tp3": {"prefill": {"tensor_parallel_size": 3}},
    "colocated": {"mode": "colocated"},
}


def compile_ms(
    suite: list[tuple[str, dict[str, Any]]], model_dir: str, compact: bool
) -> list[float]:
    from transformers import AutoConfig, AutoTokenizer

    from engine.structured.spec import StructuredOutput
    from engine.structured.xgrammar_backend import XGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    backend = XGrammarBackend(tokenizer, vocab_size, [tokenizer.eos_token_id])
    times = []
    for _, schema in suite:
        started = time.perf_counter()
        backend.compile(StructuredOutput.json(schema, any_whitespace=not compact))
        times.append((time.perf_counter() - started) * 1e3)
    return times


def _request(
    topic: str, schema: dict[str, Any], constrained: bool, compact: bool
) -> pb.GenerateRequest:
    text = f"Describe a {topic} as one JSON object matching this schema: {json.dumps(schema)}"
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)])
    if constrained:
        request.structured_output.json_schema = json.dumps(schema)
        request.structured_output.compact_json = compact
    return request


def _run(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> pb.GenerateResponse:
    last = pb.GenerateResponse()
    token_ids: list[int] = []
    texts = []
    for message in stub.Generate(request, timeout=600):
        token_ids += message.token_ids
        texts.append(message.text)
        last = message
    last.text = "".join(texts)
    del last.token_ids[:]
    last.token_ids.extend(token_ids)
    return last


def _valid(text: str, schema: dict[str, Any]) -> str | None:
    """None when `text` is JSON that validates, else why not."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    return None if error is None else error.message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="disaggregated")
    parser.add_argument("--sampling", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--any-whitespace", action="store_true")
    parser.add_argument("--tpot-rounds", type=int, default=6)
    parser.add_argument("--ttft-pairs", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from deploy.config.cluster_spec import build_cluster_spec
    from deploy.config.models import smollm2_dir
    from deploy.config.serve_config import parse_config
    from deploy.runtime.local.local_cluster import LocalCluster

    compact = not args.any_whitespace
    model_dir = str(smollm2_dir())
    suite = schemas(args.schemas)
    compiles = sorted(compile_ms(suite, model_dir, compact))
    spec = build_cluster_spec(
        parse_config(
            {
                "model": model_dir,
                "dtype": "float32",
                "router": {"port": 0},
                "ray": {"enabled": False},
                **LAYOUTS[args.layout],
            }
        )
    )
    with LocalCluster(spec) as cluster:
        cluster.start()
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            result = _measure(stub, suite, args, compact)
    result.update(
        {
            "layout": args.layout,
            "sampling": args.sampling,
            "compact_json": compact,
            "compile_ms_p50": round(compiles[len(compiles) // 2], 2),
            "compile_ms_p99": round(compiles[min(len(compiles) - 1, int(0.99 * len(compiles)))], 2),
            "model": "SmolLM2-135M-Instruct float32",
            "device": "cpu",
        }
    )
    emit(result, args.out)
    return 0


def _measure(stub, suite, args, compact: bool) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    def constrained(index: int) -> pb.GenerateRequest:
        topic, schema = suite[index]
        request = _request(topic, schema, True, compact)
        request.max_tokens = args.max_tokens
        if args.sampling:
            request.temperature, request.top_p, request.seed = 0.8, 0.95, index
        return request

    with ThreadPoolExecutor(args.batch) as pool:
        answers = list(pool.map(lambda i: _run(stub, constrained(i)), range(len(suite))))
    failures = {}
    for index, answer in enumerate(answers):
        why = _valid(answer.text, suite[index][1])
        if why is not None:
            failures[index] = why
    # TPOT: constrained and free rounds of `batch` requests, the same prompts and lengths; the
    # rounds cycle over the sets of `batch` prompts the suite has
    tpots: dict[bool, list[float]] = {True: [], False: []}
    spans: dict[bool, list[tuple[float, int]]] = {True: [], False: []}  # decode s, tokens
    round_means: dict[bool, list[float]] = {True: [], False: []}
    usable = [i for i, a in enumerate(answers) if len(a.token_ids) >= 8]
    sets = [usable[k : k + args.batch] for k in range(0, len(usable) - args.batch + 1, args.batch)]
    for round_index in range(args.tpot_rounds if sets else 0):
        chosen = sets[round_index % len(sets)]
        # the prompts' blocks go into the prefix cache first, or the first round would prefill
        # them while decoding (colocated) and the second find them cached
        warm = []
        for i in chosen:
            request = constrained(i)
            request.ClearField("structured_output")
            request.max_tokens, request.ignore_eos = 1, True
            warm.append(request)
        with ThreadPoolExecutor(args.batch) as pool:
            list(pool.map(lambda r: _run(stub, r), warm))
        # the order alternates, so that neither way always follows the warm-up
        for with_grammar in (True, False) if round_index % 2 == 0 else (False, True):
            requests = []
            for i in chosen:
                request = constrained(i)
                if not with_grammar:
                    request.ClearField("structured_output")
                    request.max_tokens = len(answers[i].token_ids)
                    request.ignore_eos = True
                requests.append(request)
            with ThreadPoolExecutor(args.batch) as pool:
                done = list(pool.map(lambda r: _run(stub, r), requests))
            tpots[with_grammar] += [d.timings.per_token_s for d in done]
            round_means[with_grammar].append(statistics.mean(d.timings.per_token_s for d in done))
            spans[with_grammar] += [
                (d.timings.per_token_s * (len(d.token_ids) - 1), len(d.token_ids) - 1) for d in done
            ]
    # TTFT, one request at a time: a first constrained run caches the grammar and the prompt's
    # blocks, then each way runs twice, in the order free, constrained, constrained, free
    differences = []
    for i in usable[: args.ttft_pairs]:
        one = constrained(i)
        one.max_tokens = 1
        free = pb.GenerateRequest()
        free.CopyFrom(one)
        free.ClearField("structured_output")
        free.ignore_eos = True
        _run(stub, one)
        ttft = [_run(stub, r).timings.first_token_s for r in (free, one, one, free)]
        differences.append((ttft[1] + ttft[2] - ttft[0] - ttft[3]) / 2 * 1e3)
    tpot_ratio = (
        statistics.mean(tpots[True]) / statistics.mean(tpots[False]) if tpots[False] else None
    )
    return {
        "schemas": len(suite),
        "valid_fraction": round(1 - len(failures) / len(suite), 4),
        "invalid": [
            {"schema": i, "why": why[:160], "tail": answers[i].text[-60:]}
            for i, why in sorted(failures.items())
        ][:20],
        "finish_reasons": _count(pb.FinishReason.Name(a.finish_reason) for a in answers),
        "mean_output_tokens": round(statistics.mean(len(a.token_ids) for a in answers), 1),
        "tpot_overhead_b16": None if tpot_ratio is None else round(tpot_ratio, 3),
        "itl_overhead_b16": _per_token(spans[True], spans[False]),
        "tpot_overhead_rounds": [
            round(c / f, 3) for c, f in zip(round_means[True], round_means[False], strict=False)
        ],
        "tpot_ms_constrained": _ms(tpots[True]),
        "tpot_ms_free": _ms(tpots[False]),
        "first_token_ms_overhead": round(statistics.median(differences), 2)
        if differences
        else None,
        "batch": args.batch,
    }


def _per_token(constrained: list[tuple[float, int]], free: list[tuple[float, int]]) -> float | None:
    """Token-weighted: decode time over decode tokens, constrained over free (vLLM's mean ITL)."""
    if not free:
        return None
    per_token = [
        sum(s for s, _ in way) / max(1, sum(n for _, n in way)) for way in (constrained, free)
    ]
    return round(per_token[0] / per_token[1], 3)


def _ms(values: list[float]) -> float | None:
    return round(1e3 * statistics.mean(values), 2) if values else None


def _count(names) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
