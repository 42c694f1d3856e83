"""`pdserve demo`: a local cluster, a few streamed generations, a per-request table, shut down.

    prefill-0 (TP=2) ──KV over gloo──▶ decode-0 / decode-1, behind the gRPC router on 127.0.0.1

Every generation goes through the public gRPC API (deploy/client.RouterClient), greedy, one after
another so each streams readably; the table comes from each request's last GenerateResponse
(usage and timings) and the cluster's record of which instances served it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from pdserve_proto.v1 import generation_pb2 as pb

from deploy.client import RouterClient
from deploy.config import KVCacheConfig, RaySection, RouterSection, ServeConfig, parse_config
from deploy.demo_model import DEMO_PROMPTS, default_cache_dir, ensure_demo_model
from deploy.launch import open_cluster
from deploy.status import format_table


@dataclass
class DemoResult:
    request_id: str
    prompt: str
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    tpot_s: float
    kv_transfer_s: float
    workers: str


def demo_config(model: str, use_ray: bool = True) -> ServeConfig:
    """One prefill instance at TP=2 and two decode instances, on 127.0.0.1, a free port."""
    config = parse_config(
        {
            "model": model,
            "prefill": {"instances": 1, "tensor_parallel_size": 2},
            "decode": {"instances": 2, "tensor_parallel_size": 1},
        }
    )
    return dataclasses.replace(
        config,
        kv_cache=KVCacheConfig(memory_mb=32),
        router=RouterSection(host="127.0.0.1", port=0),
        ray=RaySection(enabled=use_ray),
    )


def resolve_demo_model(model_dir: str | None, out: TextIO) -> str:
    if model_dir is not None:
        return model_dir
    cached = default_cache_dir() / "demo-model"
    if not (cached / "config.json").exists():
        _say(out, f"building the demo model in {cached} (first use only; about a minute)")
    started = time.monotonic()
    path = ensure_demo_model()
    _say(out, f"demo model ready: {path} ({time.monotonic() - started:.1f} s)")
    return path


def run_demo(
    model_dir: str | None = None, use_ray: bool = True, max_tokens: int = 24,
    out: TextIO = sys.stdout,
) -> list[DemoResult]:  # fmt: skip
    """Start, stream DEMO_PROMPTS, print the table, shut down; returns the rows."""
    model = resolve_demo_model(model_dir, out)
    config = demo_config(model, use_ray)
    cluster = open_cluster(config, model, say=lambda line: _say(out, line))
    results: list[DemoResult] = []
    with cluster:
        address = cluster.start(progress=lambda line: _say(out, line))
        with RouterClient(address) as client:
            client.wait_until_serving(timeout_s=60)
            for index, prompt in enumerate(DEMO_PROMPTS):
                results.append(_stream_one(client, index, prompt, max_tokens, out))
        _say(out, "shutting down")
    out.write("\n" + format_results(results) + "\n")
    out.flush()
    return results


def _stream_one(
    client: RouterClient, index: int, prompt: str, max_tokens: int, out: TextIO
) -> DemoResult:
    request_id = f"demo-{index}"
    request = pb.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0.0, request_id=request_id
    )
    out.write(f"\n> {prompt}")
    out.flush()
    pieces: list[str] = []
    last = pb.GenerateResponse()
    for response in client.generate(request, timeout_s=120):
        pieces.append(response.text)
        out.write(response.text)
        out.flush()
        last = response
    out.write("\n")
    placement = [name for name in (last.prefill_instance, last.decode_instance) if name]
    return DemoResult(
        request_id=request_id,
        prompt=prompt,
        text="".join(pieces),
        num_prompt_tokens=last.usage.prompt_tokens,
        num_output_tokens=last.usage.completion_tokens,
        ttft_s=last.timings.first_token_s,
        tpot_s=last.timings.per_token_s,
        kv_transfer_s=last.timings.kv_transfer_s,
        workers=" -> ".join(placement) if placement else "-",
    )


def format_results(results: list[DemoResult]) -> str:
    header = ["request", "prompt tok", "output tok", "TTFT ms", "TPOT ms", "KV xfer ms", "workers"]
    rows = [
        [
            r.request_id,
            str(r.num_prompt_tokens),
            str(r.num_output_tokens),
            f"{1000 * r.ttft_s:.1f}",
            f"{1000 * r.tpot_s:.1f}",
            f"{1000 * r.kv_transfer_s:.1f}",
            r.workers,
        ]
        for r in results
    ]
    return format_table(header, rows)


def _say(out: TextIO, line: str) -> None:
    out.write(f"[pdserve] {line}\n")
    out.flush()
