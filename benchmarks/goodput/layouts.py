"""The benchmark's model and the two layouts it compares, on the same devices.

Model: the engine benchmark's Llama shape (benchmarks/engine_speed.py: hidden 512, 8 layers, 8 heads,
2 KV heads, intermediate 1408; random weights, seed 0), big enough that compute dominates a step
on one core, with the byte-level BPE tokenizer of the demo model (deploy/config/demo_model.py) trained
on a few paragraphs, so the router can detokenize and ShareGPT text can be tokenized; the model's
vocabulary is the tokenizer's. `size="tiny"` is a 2-layer, hidden-64 variant for tests.

Layouts (each worker a process of its own, one core each when pinned):
  disaggregated  1 prefill instance + 1 decode instance (TP=1 each)
  colocated      2 colocated Worker replicas (the baseline: chunked prefill mixed into decode)
  adaptive       2 instances that each prefill and decode; per request the router either runs it
                 whole on one ("local") or prefills it on one and moves its KV to the other to
                 decode ("remote"), whichever its latency profile predicts meets the request's
                 SLOs (the client sends each request's own). The profile is a planner-format
                 latency profile (`pdserve profile`; DEFAULT_LATENCY_PROFILE is the bench
                 model's on the 2-core development machine); the router corrects its speed
                 online. Its engines schedule by SLO (engine/slo.py, the prefill gate).
  colocated-slo  the colocated baseline with the adaptive layout's prefill gate and no
                 placement: what the gate alone gives (an ablation; not run by default)
  single         one colocated instance with a torch thread on each core it may use, the
                 arrangement of a one-instance server such as vLLM's CPU build
All get the same EngineConfig (token budget, chunk size, KV pool), but for the gate, and the two
that move KV the same KVTransferConfig, so only the layout differs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

LAYOUTS = ("disaggregated", "colocated", "adaptive", "colocated-slo", "single")
DEFAULT_LAYOUTS = ("colocated", "disaggregated", "adaptive")
# cores (GPUs on a GPU cluster) per layout
NUM_DEVICES = {"disaggregated": 2, "colocated": 2, "adaptive": 2, "colocated-slo": 2}
KV_START_TIMEOUT_S = 600.0
# The bench model's profile on the 2-core development machine (`pdserve profile --path`); the
# tests read the same file, so it lives with their data.
DEFAULT_LATENCY_PROFILE = (
    Path(__file__).resolve().parents[2] / "tests" / "data" / "profile-2core.json"
)

_TOKENIZER_CORPUS = [
    "Disaggregated serving puts the prefill and the decode phases on different devices.",
    "A prefill instance computes the prompt's key value cache and the first token at once.",
    "A decode instance receives the cache and generates the remaining tokens one by one.",
    "Goodput counts the requests per second that meet both latency objectives.",
    "Time to first token is what a user waits before the answer starts to stream.",
    "Time per output token is how fast the rest of the answer arrives after that.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Summarize the following document in three sentences for a busy reader.",
    "The quick brown fox jumps over the lazy dog; 0123456789 ()[]{} !?.,;:",
]
TINY_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def ensure_bench_model(model_dir: str | Path, size: str = "bench") -> Path:
    """Build the benchmark model (with its tokenizer) into `model_dir` once; return the path."""
    path = Path(model_dir)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.engine_speed import MODEL_CONFIG
    from deploy.config.demo_model import save_tokenizer, train_tokenizer

    if size not in ("bench", "tiny"):
        raise ValueError(f"size must be 'bench' or 'tiny', got {size!r}")
    tokenizer = train_tokenizer(_TOKENIZER_CORPUS, vocab_size=1024)
    shape = dict(MODEL_CONFIG, vocab_size=tokenizer.get_vocab_size())
    if size == "tiny":
        shape.update(TINY_MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    save_tokenizer(tokenizer, path, shape["max_position_embeddings"])
    return path


def model_limits(model_dir: str | Path) -> tuple[int, int]:
    """(max_model_len, vocab_size) from the model's config.json."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"]), int(config["vocab_size"])


def prompt_token_range(model_dir: str | Path) -> tuple[int, int]:
    """Token ids for random prompts: past the special tokens (<unk>, <s>, </s>)."""
    return 3, model_limits(model_dir)[1]


def make_encoder(model_dir: str | Path) -> Any:
    """`encode(text, add_special_tokens) -> ids` with the model's tokenizer (ShareGPT input)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    return encode


def engine_config(model_dir: str | Path, **overrides: Any) -> Any:
    """The EngineConfig both layouts use: engine defaults, without the prefix cache (a sweep
    replays the same prompts at every rate; cached prefixes would make later rates' prefills
    nearly free), unless overridden."""
    from engine.config import EngineConfig

    config = EngineConfig(model_dir=str(model_dir), enable_prefix_caching=False)
    return dataclasses.replace(config, **overrides)


def cluster_spec(
    layout: str,
    model_dir: str | Path,
    pin_cpus: bool = True,
    latency_profile: str | Path = DEFAULT_LATENCY_PROFILE,
    **engine: Any,
) -> Any:
    """The deploy ClusterSpec of one layout on this machine (the router on a free port);
    `latency_profile` is what the adaptive layout's router predicts with."""
    from deploy.config.cluster_spec import ClusterSpec
    from kv_transfer.config import KVTransferConfig
    from router.config import RouterConfig
    from worker.config import WorkerConfig

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config = engine_config(model_dir, **engine)
    router = RouterConfig(
        model_dir=str(model_dir),
        port=0,
        block_size=config.block_size,
        max_running_requests=1024,
        max_queued_requests=4096,
        worker_timeout_s=60.0,
    )
    if layout == "single":
        cores = len(os.sched_getaffinity(0))
        return ClusterSpec(
            router=router,
            colocated=WorkerConfig(dataclasses.replace(config, num_threads=cores)),
            num_colocated_instances=1,
            pin_cpus=pin_cpus,
        )
    if layout in ("colocated", "colocated-slo"):
        gated = layout == "colocated-slo"
        return ClusterSpec(
            router=router,
            colocated=WorkerConfig(dataclasses.replace(config, slo_scheduling=gated)),
            num_colocated_instances=2,
            pin_cpus=pin_cpus,
        )
    # A decode reservation waits for its prefill to start (start_timeout_s): past the knee of a
    # sweep requests queue for minutes, and they should count as late, not as failed transfers.
    kv = KVTransferConfig(start_timeout_s=KV_START_TIMEOUT_S)
    if layout == "adaptive":
        return ClusterSpec(
            router=dataclasses.replace(router, latency_profile=str(latency_profile)),
            adaptive=WorkerConfig.adaptive(config, kv),
            num_adaptive_instances=2,
            pin_cpus=pin_cpus,
        )
    return ClusterSpec(
        router=router,
        prefill=WorkerConfig.prefill(config, kv),
        num_prefill_instances=1,
        decode=WorkerConfig.decode(config, kv),
        num_decode_instances=1,
        pin_cpus=pin_cpus,
    )


def start_local_cluster(spec: Any) -> Any:
    """A started deploy.runtime.local.local_cluster.LocalCluster (the caller shuts it down)."""
    from deploy.runtime.local.local_cluster import LocalCluster

    cluster = LocalCluster(spec)
    cluster.start()
    return cluster
