"""The disaggregated layout served on GPUs through the router: 32 concurrent streams whose
prefills finish out of order (long prompts sent first, chunked over many steps; short ones
after), every streamed token identical to transformers in float64 on the same GPU, and every KV
block back once the streams end.

On one GPU the prefill and the decode process share it and the KV moves through the same-node
transport (CUDA IPC); with two or more GPUs the same test also runs over NCCL. Skipped without
CUDA (benchmarks/gpu_checks.sh runs it on a GPU machine).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from pdserve_proto.v1 import generation_pb2 as pb

from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster
from tests.deploy.test_cuda_serving import MAX_TOKENS, hf_greedy_on_cuda, stream
from tests.engine.test_model_parity import make_prompts
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

NUM_LONG, NUM_SHORT = 8, 24  # 32 streams
TRANSPORTS = ["same_node"] + (
    ["network"] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else []
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("gpu_disagg"), "llama"))


def serve_config(model_dir: str, transport: str) -> dict[str, Any]:
    return {
        "model": model_dir,
        "device": "cuda",
        "dtype": "float64",
        "mode": "disaggregated",
        "prefill": {"instances": 1},
        "decode": {"instances": 1},
        "kv_cache": {"num_blocks": 512},
        # small chunks: a long prompt takes many steps, so short ones sent after it finish first
        "scheduler": {"chunk_size": 32, "max_num_batched_tokens": 64},
        "kv_transfer": {"transport": transport},
        "router": {"port": 0},
        "ray": {"enabled": False},
    }


def stream_all(address: str, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    """Every prompt on its own client, long ones first; (tokens, first-token time) each."""

    def one(index: int) -> tuple[list[int], float]:
        time.sleep(0.005 * index)  # submission order = prompt order
        request = pb.GenerateRequest(
            token_ids=prompts[index],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            request_id=f"gpu-disagg-{index}",
        )
        tokens: list[int] = []
        first_at = float("inf")
        for response in stream(address, request, timeout_s=300):
            if response.token_ids and not tokens:
                first_at = time.monotonic()
            tokens.extend(response.token_ids)
        return tokens, first_at

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disaggregated_streams_equal_transformers_with_prefills_out_of_order(
    model_dir: str, transport: str
) -> None:
    lens = (200, 240, 280, 320, 360, 400, 440, 480)[:NUM_LONG] + (5, 9, 17, 24) * (NUM_SHORT // 4)
    prompts = make_prompts(512, lens=lens)
    expected = hf_greedy_on_cuda(model_dir, prompts)
    config = parse_config(serve_config(model_dir, transport))
    with LocalCluster(build_cluster_spec(config)) as cluster:
        address = cluster.start()
        results = stream_all(address, prompts)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            loads = cluster.status()
            if all(load.num_free_blocks == load.num_total_blocks for load in loads):
                break
            time.sleep(0.2)
        blocks = [(load.num_free_blocks, load.num_total_blocks) for load in cluster.status()]
    assert [tokens for tokens, _ in results] == expected
    # Out of order: some short prompt, sent after every long one, had its first token before
    # the long prompts had theirs.
    last_long_first = max(first_at for _, first_at in results[:NUM_LONG])
    assert min(first_at for _, first_at in results[NUM_LONG:]) < last_long_first
    assert blocks and all(free == total for free, total in blocks), blocks
