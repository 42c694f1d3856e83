"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), labelled with custom resources the
way a real cluster labels its node groups: the placement logic puts the prefill instance (TP=2,
STRICT_PACK) on node_a and both decode instances on node_b; KV crosses between the nodes'
processes, and greedy outputs equal transformers'."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import grpc
import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.runtime.ray.cluster import RayCluster
from deploy.runtime.ray.node import descendant_pids, process_is_running, use_loopback_node_address
from tests.deploy.ray_support import (
    hf_greedy,
    make_prompts,
    serve_spec,
    stream_all,
    tiny_model_with_tokenizer,
)

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

PROMPTS = make_prompts((4, 9, 17, 26, 31, 12, 40, 6), seed=5)
MAX_TOKENS = 10


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def test_prefill_on_one_node_decode_on_the_other(tmp_path) -> None:
    other_pids = set(descendant_pids(os.getpid()))
    model_dir = tiny_model_with_tokenizer(tmp_path)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    use_loopback_node_address()
    ray_temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-", dir="/tmp")  # short socket paths
    pids: list[int] = []
    os.makedirs("/tmp/ray", exist_ok=True)  # cluster_utils writes its address there
    nodes = Cluster(initialize_head=False)
    try:
        nodes.add_node(
            num_cpus=1,
            resources={"node_a": 1},
            include_dashboard=False,
            node_ip_address="127.0.0.1",
            temp_dir=ray_temp_dir,
        )
        nodes.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.1")
        nodes.wait_for_nodes()
        spec = serve_spec(
            model_dir,
            dtype="float64",
            prefill={"tensor_parallel_size": 2},
            decode={"instances": 2},
            kv_cache={"block_size": 8, "num_blocks": 128},
            router={"shutdown_grace_s": 5.0},
            ray={
                "address": nodes.address,
                "prefill_resources": {"node_a": 0.01},
                "decode_resources": {"node_b": 0.01},
            },
        )
        with RayCluster(spec) as cluster:
            cluster.start()
            results = stream_all(cluster.address, PROMPTS, MAX_TOKENS)
            assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(
                PROMPTS
            )
            assert [r.token_ids for r in results] == expected
            node_a, node_b = _node_with("node_a"), _node_with("node_b")
            assert node_a != node_b
            placed = {w.instance_id: w.node_id for w in cluster.status().workers}
            assert placed == {"prefill-0": node_a, "decode-0": node_b, "decode-1": node_b}
            pids = sorted(set(descendant_pids(os.getpid())) - other_pids)
        assert not ray.is_initialized()  # joined, not owned: disconnected, the nodes stay up
    finally:
        nodes.shutdown()
        shutil.rmtree(ray_temp_dir, ignore_errors=True)
    deadline = time.monotonic() + 15
    while any(process_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if process_is_running(pid)] == []
