"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), labelled with custom resources the
way a real cluster labels its node groups, one cluster for the module and each layout on it in
turn. Disaggregated: the placement logic puts the prefill instance (TP=2, STRICT_PACK) on node_a
and both decode instances on node_b. Colocated and adaptive: one replica per node (each node
has room for one worker); the adaptive router is then made to split the two (one prefills, one
decodes), so user requests hand their KV from one node to the other. KV crosses between the
nodes' processes over the network transport, as between real nodes; greedy outputs equal
transformers' and every KV pool returns to its size. `pdserve status` shows each instance's node."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc
from ray.util import placement_group_table

from deploy.cli.main import main
from deploy.runtime.ray.cluster import RayCluster
from tests.deploy.ray_support import (
    hf_greedy,
    make_prompts,
    serve_spec,
    stream_all,
    tiny_model_with_tokenizer,
    two_ray_nodes,
)

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

PROMPTS = make_prompts((4, 9, 17, 26, 31, 12, 40, 6), seed=5)
MAX_TOKENS = 10
NUM_BLOCKS = 128
SPLIT_PROMPTS = make_prompts((60, 70, 80, 90, 50, 65, 75, 85, 55, 95, 45, 72), seed=7)
SPLIT_TOKENS = 24
TTFT_SLO_S, TPOT_SLO_S = 60.0, 0.001  # every TTFT meets it, every decode step misses it
PROFILE = str(Path(__file__).resolve().parents[2] / "tests/data/profile-2core.json")


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("multinode"))


@pytest.fixture(scope="module")
def expected(model_dir: str) -> list[list[int]]:
    return hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    with two_ray_nodes(num_cpus=1) as address:  # room for one worker a node
        yield address


LAYOUTS: dict[str, dict[str, Any]] = {
    "disaggregated": {
        "prefill": {"tensor_parallel_size": 2},
        "decode": {"instances": 2},
        "ray": {"prefill_resources": {"node_a": 0.01}, "decode_resources": {"node_b": 0.01}},
    },
    "colocated": {"mode": "colocated", "colocated": {"instances": 2}},
    "adaptive": {
        "mode": "adaptive",
        "adaptive": {"instances": 2},
        "router": {"latency_profile": PROFILE},
    },
    # TP=2: each instance's two ranks packed on one node (half a CPU each: one instance a node)
    "adaptive-tp2": {
        "mode": "adaptive",
        "adaptive": {"instances": 2, "tensor_parallel_size": 2},
        "router": {"latency_profile": PROFILE},
        "ray": {"num_cpus_per_worker": 0.5},
    },
}


@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_each_layout_across_two_nodes_equals_transformers(
    mode: str,
    two_nodes: str,
    model_dir: str,
    expected: list[list[int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    layout = LAYOUTS[mode]
    spec = serve_spec(
        model_dir,
        **{k: v for k, v in layout.items() if k not in ("router", "ray")},
        dtype="float64",
        kv_cache={"block_size": 8, "num_blocks": NUM_BLOCKS},
        kv_transfer={"transport": "network"},
        router={"shutdown_grace_s": 5.0, "metrics_port": 0, **layout.get("router", {})},
        ray={"address": two_nodes, **layout.get("ray", {})},
    )
    with RayCluster(spec) as cluster:
        cluster.start()  # for disaggregated and adaptive: a hand-off through every pair first
        results = stream_all(cluster.address, PROMPTS, MAX_TOKENS)
        assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(PROMPTS)
        assert [r.token_ids for r in results] == expected
        node_a, node_b = _node_with("node_a"), _node_with("node_b")
        assert node_a != node_b
        placed = {w.instance_id: w.node_id for w in cluster.status().workers}
        if mode == "disaggregated":
            assert placed == {"prefill-0": node_a, "decode-0": node_b, "decode-1": node_b}
        else:
            role = mode.split("-")[0]
            assert sorted(placed) == [f"{role}-0", f"{role}-1"]
        assert set(placed.values()) == {node_a, node_b}  # replicas spread over both nodes
        assert _rank_nodes(cluster) == {i: [placed[i]] * p.tp_size for i, p in _by_id(cluster)}
        if mode.startswith("adaptive"):
            _split_hands_kv_across_nodes(cluster, model_dir, placed)
        _wait_for_pools(cluster)
        settled = {
            instance_id: [f"127.0.0.1/{node_id[:8]}", "healthy", "0", "0", f"0/{NUM_BLOCKS}"]
            for instance_id, node_id in placed.items()
        }
        deadline = time.monotonic() + 10  # the router's next load refresh
        while (rows := _status_rows(cluster, capsys)) != settled and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rows == settled
    assert not ray.is_initialized()  # joined, not owned: disconnected, the nodes stay up


def _generate(address: str, prompt: list[int]) -> tuple[list[int], pb.GenerateResponse]:
    """A greedy stream whose TPOT objective no step meets: (its tokens, its last message)."""
    request = pb.GenerateRequest(
        token_ids=prompt,
        max_tokens=SPLIT_TOKENS,
        ignore_eos=True,
        ttft_slo_s=TTFT_SLO_S,
        tpot_slo_s=TPOT_SLO_S,
    )
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1]


def _split_hands_kv_across_nodes(
    cluster: RayCluster, model_dir: str, placed: dict[str, str]
) -> None:
    """A window of requests that all miss their TPOT makes the router's layout search split
    the two instances (one prefills, the other decodes: router/adaptive/layout_model.py); the
    requests after it are placed remote, so their KV crosses from one node to the other."""
    expected = hf_greedy(model_dir, SPLIT_PROMPTS, SPLIT_TOKENS)
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda p: _generate(cluster.address, p), SPLIT_PROMPTS * 2))
        then = list(pool.map(lambda p: _generate(cluster.address, p), SPLIT_PROMPTS))
    assert [tokens for tokens, _ in first + then] == expected * 3
    remote = [last for _, last in first + then if last.placement.kind == "remote"]
    assert len(remote) >= len(then), [last.placement.kind for _, last in first + then]
    for last in remote:
        assert placed[last.prefill_instance] != placed[last.decode_instance]


def _by_id(cluster: RayCluster) -> list[tuple[str, Any]]:
    return [(p.instance_id, p) for p in cluster.placements]


def _rank_nodes(cluster: RayCluster) -> dict[str, list[str]]:
    """The node of each TP rank's bundle, by instance."""
    nodes = {}
    for instance_id, placement in _by_id(cluster):
        table = placement_group_table(placement.placement_group)
        nodes[instance_id] = [table["bundles_to_node_id"][b] for b in placement.bundle_indices]
    return nodes


def _wait_for_pools(cluster: RayCluster) -> None:
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        loads = [w.load for w in cluster.status().workers]
        if all(load is not None and load.num_free_blocks == NUM_BLOCKS for load in loads):
            return
        time.sleep(0.2)
    assert [w.load and w.load.num_free_blocks for w in cluster.status().workers] == [
        NUM_BLOCKS
    ] * len(loads)


def _status_rows(cluster: RayCluster, capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    """What `pdserve status` prints for each instance: node, health, waiting, running, KV."""
    capsys.readouterr()
    metrics = f"127.0.0.1:{cluster.metrics_port}"
    assert main(["status", "--address", cluster.address, "--metrics", metrics]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"router {cluster.address}: SERVING"
    assert lines[1].split() == [
        "instance",
        "role",
        "node",
        "health",
        "waiting",
        "running",
        "KV",
        "blocks",
        "KV",
        "used",
    ]
    end = next(i for i, line in enumerate(lines) if line.startswith("requests:"))
    rows = [line.split() for line in lines[2:end]]  # the KV link table follows the summary
    return {row[0]: row[2:7] for row in rows}
