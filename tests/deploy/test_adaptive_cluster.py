"""The adaptive layout end to end (LocalCluster: worker processes, the real router, gRPC on
127.0.0.1): each request is placed local or remote by its SLOs, greedy outputs are
token-identical to transformers whichever placement it took, every KV pool returns to its
start, and the placement with its predictions comes back on the last message."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
from pdserve_proto.v1 import generation_pb2 as pb

from deploy.cli.client import RouterClient
from deploy.config.cluster_spec import ClusterSpec
from deploy.runtime.local.local_cluster import LocalCluster
from kv_transfer.config import KVTransferConfig
from router.config import RouterConfig
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model
from tests.workers.test_admission import NUM_BLOCKS, engine_config
from worker.config import WorkerConfig

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/results/placement/profile-2core.json"
MAX_TOKENS = 8
TIGHT = {"ttft_slo_s": 60.0, "tpot_slo_s": 1e-4}  # no colocated stall fits: decode apart
LOOSE = {"ttft_slo_s": 60.0, "tpot_slo_s": 30.0}  # anything fits: run where it is prefilled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("adaptive"), "llama"))


def adaptive_spec(model_dir: str) -> ClusterSpec:
    router = RouterConfig(model_dir=model_dir, port=0, block_size=8, latency_profile=str(PROFILE))
    worker = WorkerConfig.adaptive(engine_config(model_dir), KVTransferConfig(start_timeout_s=8.0))
    return ClusterSpec(router=router, adaptive=worker, num_adaptive_instances=2, pin_cpus=False)


def generate(address: str, prompt: list[int], request_id: str, slo: dict[str, float]) -> list:
    request = pb.GenerateRequest(
        token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id, **slo
    )
    with RouterClient(address) as client:
        return list(client.generate(request, timeout_s=60))


def test_local_and_remote_placements_are_token_identical_to_transformers(model_dir: str) -> None:
    prompts = make_prompts((30, 9, 41, 17, 25, 12, 36, 20), seed=23)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    slos = [TIGHT, LOOSE] * 4
    with LocalCluster(adaptive_spec(model_dir), restart_workers=False) as cluster:
        address = cluster.start()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(generate, address, prompt, f"r{i}", slo)
                for i, (prompt, slo) in enumerate(zip(prompts, slos, strict=True))
            ]
            results = [future.result(timeout=120) for future in futures]
        for responses, reference, slo in zip(results, expected, slos, strict=True):
            assert [t for r in responses for t in r.token_ids] == reference
            last = responses[-1]
            assert last.placement.kind == ("remote" if slo is TIGHT else "local")
            assert last.placement.predicted_ttft_s > 0 and last.placement.predicted_tpot_s > 0
            if last.placement.kind == "remote":
                assert last.decode_instance not in ("", last.prefill_instance)
                assert last.placement.prefill_role_instances == 1
            else:
                assert last.decode_instance == ""
        deadline = time.monotonic() + 10.0
        while any(load.num_free_blocks != NUM_BLOCKS for load in cluster.status()):
            assert time.monotonic() < deadline, [load.num_free_blocks for load in cluster.status()]
            time.sleep(0.05)


def test_a_bad_slo_is_invalid_argument(model_dir: str) -> None:
    import grpc

    with LocalCluster(adaptive_spec(model_dir), restart_workers=False) as cluster:
        address = cluster.start()
        for bad in ({"tpot_slo_s": 0.0}, {"ttft_slo_s": -1.0}, {"ttft_slo_s": float("nan")}):
            with pytest.raises(grpc.RpcError) as raised:
                generate(address, [5, 6, 7], "bad", bad)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "slo_s must be a number of seconds > 0" in raised.value.details()
