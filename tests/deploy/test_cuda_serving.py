"""The serving cluster on CUDA: workers in their own processes on the GPU, the real router, gRPC
on 127.0.0.1, and greedy output token-identical to transformers in float64 on the same GPU.

The engine's own GPU parity is tests/engine/test_cuda.py; this runs the whole request path
(router, worker process, scheduler, streaming) on a GPU. One GPU serves a colocated instance;
the disaggregated layout over NCCL needs two (NCCL refuses two ranks on one GPU, and
LocalCluster refuses such a layout before starting anything), so its test skips on fewer; over
the same-node transport one GPU serves it (tests/workers/test_gpu_disaggregated.py). Skipped
without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster
from tests.engine.test_model_parity import make_prompts
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import load_hf_model, make_tiny_model

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
DISAGGREGATED = {"mode": "disaggregated", "prefill": {"instances": 1}, "decode": {"instances": 1}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("cuda_serving"), "llama"))


def hf_greedy_on_cuda(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    hf = load_hf_model(model_dir, torch.float64).to("cuda")
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    del hf
    torch.cuda.empty_cache()
    return outputs


def stream(
    address: str, request: pb.GenerateRequest, timeout_s: float
) -> Iterator[pb.GenerateResponse]:
    """One request's streamed responses over a channel of its own. Not deploy.cli.client's
    RouterClient: it needs grpcio-health-checking, which the GPU image lacks."""
    with grpc.insecure_channel(address) as channel:
        yield from pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s)


def serve_config(model_dir: str, **layout: Any) -> dict[str, Any]:
    return {
        "model": model_dir,
        "device": "cuda",
        "dtype": "float64",
        "kv_cache": {"num_blocks": 256},
        "router": {"port": 0},
        "ray": {"enabled": False},
        **layout,
    }


def generate_all(
    address: str, prompts: list[list[int]]
) -> list[tuple[list[int], pb.GenerateResponse]]:
    """Every prompt at once (one client each), so that the decode steps batch them."""

    def one(index: int) -> tuple[list[int], pb.GenerateResponse]:
        request = pb.GenerateRequest(
            token_ids=prompts[index],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            request_id=f"cuda-{index}",
        )
        responses = list(stream(address, request, timeout_s=120))
        return [t for r in responses for t in r.token_ids], responses[-1]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_colocated_on_one_gpu_streams_what_transformers_generates(model_dir: str) -> None:
    prompts = make_prompts(512, lens=(5, 17, 33, 64))
    expected = hf_greedy_on_cuda(model_dir, prompts)
    config = parse_config(serve_config(model_dir, mode="colocated"))
    with LocalCluster(build_cluster_spec(config)) as cluster:
        address = cluster.start()
        results = generate_all(address, prompts)
        results += generate_all(address, prompts[:1])  # a second pass: prefix-cache hit
    assert [tokens for tokens, _ in results] == expected + expected[:1]
    assert {last.prefill_instance for _, last in results} == {"colocated-0"}


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="the disaggregated layout needs two GPUs (NCCL refuses two ranks on one)",
)
def test_disaggregated_on_two_gpus_hands_kv_over_nccl_and_matches_transformers(
    model_dir: str,
) -> None:
    prompts = make_prompts(512, lens=(5, 17, 33, 64))
    expected = hf_greedy_on_cuda(model_dir, prompts)
    layout = {**DISAGGREGATED, "kv_transfer": {"transport": "network"}}  # NCCL, not CUDA IPC
    config = parse_config(serve_config(model_dir, **layout))
    with LocalCluster(build_cluster_spec(config)) as cluster:
        address = cluster.start()
        results = generate_all(address, prompts)
    assert [tokens for tokens, _ in results] == expected
    assert {(last.prefill_instance, last.decode_instance) for _, last in results} == {
        ("prefill-0", "decode-0")
    }


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() != 1,
    reason="checks the refusal on a machine with exactly one GPU",
)
def test_disaggregated_on_one_gpu_is_refused_before_any_worker_starts(model_dir: str) -> None:
    """Over NCCL only: the same-node transport shares the GPU (tests/workers/
    test_gpu_disaggregated.py)."""
    layout = {**DISAGGREGATED, "kv_transfer": {"transport": "network"}}
    config = parse_config(serve_config(model_dir, **layout))
    with LocalCluster(build_cluster_spec(config)) as cluster:
        with pytest.raises(ValueError, match="needs 2 GPUs .* and 1 are visible"):
            cluster.start()
        assert cluster.workers == {}
