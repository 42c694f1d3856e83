"""LocalCluster (the no-Ray runtime): core sets per worker, and a colocated layout of pinned
replicas serving through the real router, with every process gone after shutdown."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from pdserve_proto.v1 import generation_pb2 as pb

from deploy.cli.client import RouterClient
from deploy.config.cluster_spec import build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster, cores_per_worker, cpu_sets, gpu_sets
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model


def test_a_worker_gets_a_core_per_torch_thread_of_each_rank(tmp_path: Path) -> None:
    """The one-instance layout: both cores to one worker running a thread on each."""
    from benchmarks.goodput.layouts import cluster_spec

    single = cluster_spec("single", tmp_path, pin_cpus=False)
    cores = len(os.sched_getaffinity(0))
    assert single.num_colocated_instances == 1 and single.colocated.engine.num_threads == cores
    assert cores_per_worker([single.colocated]) == [cores]
    two_ranks = dataclasses.replace(
        single.colocated,
        engine=dataclasses.replace(single.colocated.engine, tensor_parallel_size=2),
    )
    assert cores_per_worker([two_ranks, single.colocated]) == [2 * cores, cores]
    assert cpu_sets([2], [0, 1]) == [[0, 1]]


def test_cpu_sets_give_each_rank_a_core_in_order_and_wrap_around() -> None:
    assert cpu_sets([2, 1, 1], [0, 1, 2, 3]) == [[0, 1], [2], [3]]
    assert cpu_sets([2, 1, 1], [0, 1]) == [[0, 1], [0], [1]]
    assert cpu_sets([1, 1, 1], [4, 6]) == [[4], [6], [4]]
    assert cpu_sets([3], [5]) == [[5]]


def test_gpu_sets_give_each_rank_its_own_gpu_and_refuse_a_layout_that_needs_more() -> None:
    assert gpu_sets([2, 1, 1], 4) == [[0, 1], [2], [3]]
    assert gpu_sets([1], 8) == [[0]]
    with pytest.raises(ValueError, match="needs 2 GPUs .* and 1 are visible"):
        gpu_sets([1, 1], 1)
    # the same-node transport: workers take turns, a worker's TP ranks stay on distinct GPUs
    assert gpu_sets([1, 1, 1], 1, share=True) == [[0], [0], [0]]
    assert gpu_sets([2, 1, 1], 2, share=True) == [[0, 1], [0], [1]]
    with pytest.raises(ValueError, match="needs 3 GPUs"):
        gpu_sets([2, 1], 1, share=True)  # a TP=2 instance cannot put both ranks on one GPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("lc_model"), "llama"))


@pytest.mark.slow
def test_colocated_replicas_are_pinned_serve_round_robin_and_leave_nothing(
    model_dir: str,
) -> None:
    config = parse_config(
        {
            "model": model_dir,
            "mode": "colocated",
            "pin_cpus": True,
            "colocated": {"instances": 2, "policy": "round_robin"},
            "kv_cache": {"num_blocks": 32},
            "router": {"port": 0},
            "ray": {"enabled": False},
        }
    )
    cores = sorted(os.sched_getaffinity(0))
    progress: list[str] = []
    with LocalCluster(build_cluster_spec(config)) as cluster:
        address = cluster.start(progress=progress.append)
        pids = {i: worker.pid for i, worker in cluster.workers.items()}
        for index, instance_id in enumerate(["colocated-0", "colocated-1"]):
            assert os.sched_getaffinity(pids[instance_id]) == {cores[index % len(cores)]}
        placed = []
        with RouterClient(address) as client:
            for n in range(4):
                request = pb.GenerateRequest(
                    prompt="The quick brown fox", max_tokens=5, ignore_eos=True, request_id=f"r{n}"
                )
                responses = list(client.generate(request, timeout_s=60))
                assert sum(len(r.token_ids) for r in responses) == 5
                placed.append(responses[-1].prefill_instance)
                assert responses[-1].decode_instance == ""
        assert sorted(placed) == ["colocated-0", "colocated-0", "colocated-1", "colocated-1"]
        assert [load.healthy for load in cluster.status()] == [True, True]
    assert progress[0].startswith("starting colocated-0 (TP=1): loading ")
    assert progress[-1].startswith(f"ready on {address} in ")
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids.values() if _running(pid)] == []


def _running(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
