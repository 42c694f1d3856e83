"""The serving path with the GPU image's packages: router, worker process and gRPC on CPU.

The GPU image has no grpcio-health-checking, grpcio-reflection, FastAPI or uvicorn, and its GPU
serving tests skip on CPU, so `benchmarks/gpu_checks.sh --dry-run` runs this file (step
serve-cpu) to show the same path starts and serves there. Where grpc_health is installed (CI)
it skips: tests/deploy/test_local_cluster.py covers the full package set.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb

from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster
from tests.deploy.test_cuda_serving import stream
from tests.engine.test_model_parity import hf_greedy, make_prompts
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("grpc_health") is not None,
        reason="checks serving without grpcio-health-checking (gpu_checks.sh --dry-run)",
    ),
]

MAX_TOKENS = 8


def test_colocated_serves_transformers_tokens_without_the_health_packages(tmp_path: Path) -> None:
    model_dir = add_tiny_tokenizer(make_tiny_model(tmp_path, "llama"))
    prompts = make_prompts(512, lens=(5, 17))
    config = {
        "model": model_dir,
        "device": "cpu",
        "dtype": "float64",
        "mode": "colocated",
        "kv_cache": {"num_blocks": 64},
        "router": {"port": 0},
        "ray": {"enabled": False},
    }
    with LocalCluster(build_cluster_spec(parse_config(config))) as cluster:
        address = cluster.start()
        tokens = []
        for index, prompt in enumerate(prompts):
            request = pb.GenerateRequest(
                token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=f"cpu-{index}"
            )
            tokens.append([t for r in stream(address, request, timeout_s=60) for t in r.token_ids])
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED  # no health service to ask
    assert tokens == hf_greedy(model_dir, prompts, MAX_TOKENS)
