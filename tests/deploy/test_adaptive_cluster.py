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


def adaptive_spec(model_dir: str, window_s: float = 10.0) -> ClusterSpec:
    router = RouterConfig(
        model_dir=model_dir, port=0, block_size=8, latency_profile=str(PROFILE),
        adaptive_window_s=window_s,
    )  # fmt: skip
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


def test_a_shift_from_tight_to_loose_traffic_moves_the_roles_and_fails_nothing(
    model_dir: str,
) -> None:
    """The shift workload's two halves, as SLOs: long prompts held to a TPOT no colocated stall
    fits, then short ones that fit anywhere. The roles move from one prefill instance to none
    within the window (2 s here), with no restart, and every request of both halves ends well."""
    window_s = 2.0
    tight = make_prompts((40, 44, 38, 42, 46, 40), seed=5)
    loose = make_prompts((8, 10, 12, 9, 11, 7, 10, 9, 12, 8, 11, 10), seed=6)
    with LocalCluster(adaptive_spec(model_dir, window_s), restart_workers=False) as cluster:
        address = cluster.start()
        pids = {i: worker.pid for i, worker in cluster.workers.items()}
        lasts = []
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(generate, address, p, f"t{i}", TIGHT)
                       for i, p in enumerate(tight)]  # fmt: skip
            lasts += [future.result(timeout=120)[-1] for future in futures]
        began = time.monotonic()
        for i, prompt in enumerate(loose):  # one every ~0.3 s, past the window
            lasts.append(generate(address, prompt, f"l{i}", LOOSE)[-1])
            time.sleep(max(0.0, began + 0.3 * (i + 1) - time.monotonic()))
        assert time.monotonic() - began > window_s
        assert all(last.finish_reason == pb.FINISH_REASON_LENGTH for last in lasts)
        roles = [last.placement.prefill_role_instances for last in lasts]
        kinds = [last.placement.kind for last in lasts]
        assert roles[: len(tight)] == [1] * len(tight) and kinds[: len(tight)] == ["remote"] * 6
        assert roles[-3:] == [0, 0, 0] and kinds[-3:] == ["local"] * 3  # the roles moved
        assert {last.prefill_instance for last in lasts[-6:]} == set(pids)  # both replicas serve
        assert {i: worker.pid for i, worker in cluster.workers.items()} == pids  # no restart
        deadline = time.monotonic() + 10.0
        while any(load.num_free_blocks != NUM_BLOCKS for load in cluster.status()):
            assert time.monotonic() < deadline, [load.num_free_blocks for load in cluster.status()]
            time.sleep(0.05)
