"""The adaptive layout end to end (LocalCluster: worker processes, the real router, gRPC on
127.0.0.1): each request is placed local or remote by its SLOs, greedy outputs are
token-identical to transformers whichever placement it took, every KV pool returns to its
start, and the placement with its predictions comes back on the last message."""

from __future__ import annotations

import collections
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

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

PROFILE = Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json"
MAX_TOKENS = 8
TIGHT = {"ttft_slo_s": 60.0, "tpot_slo_s": 1e-4}  # nothing meets it
LOOSE = {"ttft_slo_s": 60.0, "tpot_slo_s": 30.0}  # anything fits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("adaptive"), "llama"))


def adaptive_spec(model_dir: str, window_s: float = 10.0) -> ClusterSpec:
    router = RouterConfig(
        model_dir=model_dir,
        port=0,
        block_size=8,
        latency_profile=str(PROFILE),
        adaptive_window_s=window_s,
    )
    worker = WorkerConfig.adaptive(engine_config(model_dir), KVTransferConfig(start_timeout_s=8.0))
    return ClusterSpec(router=router, adaptive=worker, num_adaptive_instances=2, pin_cpus=False)


def generate(address: str, prompt: list[int], request_id: str, slo: dict[str, float]) -> list:
    request = pb.GenerateRequest(
        token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id, **slo
    )
    with RouterClient(address) as client:
        return list(client.generate(request, timeout_s=60))


def wait_for_pools(cluster: LocalCluster, num_blocks: int = NUM_BLOCKS) -> None:
    deadline = time.monotonic() + 10.0
    while any(load.num_free_blocks != num_blocks for load in cluster.status()):
        assert time.monotonic() < deadline, [load.num_free_blocks for load in cluster.status()]
        time.sleep(0.05)


def test_greedy_outputs_are_token_identical_to_transformers_whichever_placement(
    model_dir: str,
) -> None:
    """Concurrent requests with tight and loose SLOs: each is placed (local here; the remote
    path's parity is tests/workers/test_mixed_role.py's, both directions between two adaptive
    instances), its tokens equal transformers', its placement comes back on the last message."""
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
        for responses, reference in zip(results, expected, strict=True):
            assert [t for r in responses for t in r.token_ids] == reference
            last = responses[-1]
            assert last.placement.kind in ("local", "remote")
            assert last.placement.predicted_ttft_s > 0 and last.placement.predicted_tpot_s > 0
            if last.placement.kind == "remote":
                assert last.decode_instance not in ("", last.prefill_instance)
                assert last.placement.prefill_role_instances >= 1
            else:
                assert last.decode_instance == ""
        assert {last.prefill_instance for last in (r[-1] for r in results)} == set(cluster.workers)
        wait_for_pools(cluster)


def test_a_bad_slo_is_invalid_argument(model_dir: str) -> None:
    import grpc

    with LocalCluster(adaptive_spec(model_dir), restart_workers=False) as cluster:
        address = cluster.start()
        for bad in ({"tpot_slo_s": 0.0}, {"ttft_slo_s": -1.0}, {"ttft_slo_s": float("nan")}):
            with pytest.raises(grpc.RpcError) as raised:
                generate(address, [5, 6, 7], "bad", bad)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "slo_s must be a number of seconds > 0" in raised.value.details()


def held_chunks(cluster: LocalCluster) -> float:
    return sum(load.details.num_held_chunks or 0 for load in cluster.status())


def test_a_shift_from_tight_to_loose_traffic_moves_what_the_instances_admit(
    tmp_path: Path,
) -> None:
    """The shift workload's two halves, as SLOs, on a model whose prompt costs many decode
    steps: long prompts held to a TPOT of about two decode steps, then the same prompts with a
    TPOT that fits anything. In the first half the instances' gates hold prompt chunks back
    while tight decodes run (what each admits beside its decodes moves with the traffic); in the
    second they hold none. No restart, every request of both halves ends well, every pool is
    back to its start."""
    model = add_tiny_tokenizer(
        make_tiny_model(
            tmp_path,
            "llama",
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            max_position_embeddings=1024,
        )
    )
    # The gates alone: the layout search splits the cluster once local
    # requests miss their TPOT (the tight half's 1.6-step TPOT does), and a split taken stays
    # while its requests do well, loose ones included; its moves are tested in
    # tests/router/test_layout_model.py.
    router = RouterConfig(
        model_dir=model,
        port=0,
        block_size=8,
        latency_profile=str(PROFILE),
        adaptive_window_s=2.0,
        adaptive_layout_search=False,
    )
    engine = engine_config(model, dtype="float32", num_kv_blocks=512)
    worker = WorkerConfig.adaptive(engine, KVTransferConfig(start_timeout_s=8.0))
    spec = ClusterSpec(router=router, adaptive=worker, num_adaptive_instances=2, pin_cpus=False)
    prompts = make_prompts([400 + 8 * i for i in range(12)], seed=7)

    def send_all(slo: dict[str, float], tag: str, max_tokens: int = 12) -> list:
        gap_s = 0.02
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = []
            for i, prompt in enumerate(prompts):
                request = pb.GenerateRequest(
                    token_ids=prompt,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    request_id=f"{tag}{i}",
                    **slo,
                )
                futures.append(pool.submit(_stream, address, request))
                time.sleep(gap_s)
            return [future.result(timeout=120)[-1] for future in futures]

    with LocalCluster(spec, restart_workers=False) as cluster:
        address = cluster.start()
        pids = {i: w.pid for i, w in cluster.workers.items()}
        # The engines learn their step costs (a gate lets every chunk through until its
        # instance has prefilled 3 prompts: engine/step_costs.py MIN_WEIGHT); the router, their
        # speed. Where each warm-up prompt goes is the router's choice, so count them.
        prefilled: collections.Counter[str] = collections.Counter()
        for i in range(12):
            if len(prefilled) == len(pids) and min(prefilled.values()) >= 3:
                break
            last = _stream(
                address,
                pb.GenerateRequest(
                    token_ids=prompts[i % len(prompts)],
                    max_tokens=12,
                    ignore_eos=True,
                    request_id=f"w{i}",
                ),
            )[-1]
            prefilled[last.prefill_instance] += 1
        assert min(prefilled.values()) >= 3 and len(prefilled) == len(pids), prefilled
        arrivals: list[float] = []
        timed = _stream(
            address,
            pb.GenerateRequest(
                token_ids=prompts[0], max_tokens=12, ignore_eos=True, request_id="calibrate"
            ),
            arrivals,
        )
        assert timed[-1].finish_reason == pb.FINISH_REASON_LENGTH
        tpot_s = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)  # one decode step, alone
        tight = {"ttft_slo_s": 60.0, "tpot_slo_s": 1.6 * tpot_s}
        lasts = send_all(tight, "t")
        held_tight = held_chunks(cluster)
        lasts += send_all(LOOSE, "l")
        held_loose = held_chunks(cluster) - held_tight
        assert all(last.finish_reason == pb.FINISH_REASON_LENGTH for last in lasts)
        assert held_tight > 0 and held_loose == 0, (held_tight, held_loose)
        assert {last.prefill_instance for last in lasts[-12:]} == set(pids)  # both serve
        assert {i: w.pid for i, w in cluster.workers.items()} == pids  # no restart
        wait_for_pools(cluster, 512)


def _stream(address: str, request: pb.GenerateRequest, arrivals: list[float] | None = None) -> list:
    """The responses; `arrivals` gets each one's arrival time (time.monotonic())."""
    responses = []
    with RouterClient(address) as client:
        for response in client.generate(request, timeout_s=60):
            responses.append(response)
            if arrivals is not None:
                arrivals.append(time.monotonic())
    return responses
