"""Helpers for the Ray deployment tests: a tiny model with a tokenizer, its ClusterSpec, gRPC
streams, a simulated two-node Ray cluster, and checks on listening sockets and processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.config.cluster_spec import ClusterSpec, build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.ray.node import (
    descendant_pids,
    kill_and_wait,
    process_is_running,
    use_loopback_node_address,
)
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.listening import is_loopback, listening_addresses
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

__all__ = ["hf_greedy", "make_prompts"]


def tiny_model_with_tokenizer(folder: Path) -> str:
    """The tiny llama of tests/tiny_models.py with the tiny tokenizer in its folder."""
    return add_tiny_tokenizer(Path(make_tiny_model(folder, "llama")))


def serve_spec(model_dir: str, **sections: Any) -> ClusterSpec:
    """The ClusterSpec of a serve config written as its YAML mapping (dtype="float64",
    prefill={"tensor_parallel_size": 2}, ...); the router binds a free port unless told."""
    router = {"port": 0, **sections.pop("router", {})}
    return build_cluster_spec(parse_config({"model": model_dir, "router": router, **sections}))


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    num_messages: int = 0


def stream(
    address: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 60.0,
    started: list[int] | None = None,
) -> StreamResult:
    """One greedy Generate stream over a real gRPC channel; `started` gets 1 appended at the
    first message (so a test can act while streams are running)."""
    result = StreamResult()
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        try:
            for message in pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s):
                result.token_ids.extend(message.token_ids)
                result.num_messages += 1
                if result.num_messages == 1 and started is not None:
                    started.append(1)
        except grpc.RpcError as error:
            result.code, result.details = error.code(), error.details() or ""
    return result


def stream_all(address: str, prompts: list[list[int]], max_tokens: int) -> list[StreamResult]:
    """Every prompt as its own concurrent stream."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: stream(address, prompt, max_tokens), prompts))


def start_streams(
    address: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[threading.Thread], list[Any]]:
    """Every prompt as a stream on its own thread; returns once each has its first message (30 s
    at most). The results list fills in as the threads end."""
    started: list[int] = []
    results: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = stream(address, prompts[i], max_tokens, 60.0, started)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(started) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.005)
    return threads, results


def kill_the_busiest(cluster: Any, workers: list[Any], timeout_s: float = 30.0) -> Any:
    """SIGKILL the instance of `workers` that reports the most running streams, and return its
    status. The loads are read in one round trip and the kill follows at once: on a quiet machine
    the tiny model decodes a 400-token stream in about a second, and a slow read let a victim's
    streams finish before the kill."""
    import ray  # noqa: PLC0415 - only the Ray tests use this

    from worker.protocol import Load  # noqa: PLC0415

    actors = [ray.get_actor(f"pdserve-{w.instance_id}", cluster.namespace) for w in workers]
    deadline = time.monotonic() + timeout_s
    while True:
        loads = ray.get([actor.call.remote(Load()) for actor in actors], timeout=10)
        running = [load.num_running for load in loads]
        if max(running) > 0:
            break
        assert time.monotonic() < deadline, f"no instance reports a stream: {loads}"
        time.sleep(0.01)
    victim = workers[running.index(max(running))]
    os.kill(victim.pids[0], signal.SIGKILL)
    return victim


def wait_restarted(cluster: Any, victim: Any, timeout_s: float = 90.0) -> None:
    """Until Ray has restarted `victim` (healthy, a new process) and the cluster serves again,
    plus a load refresh or two, so the router sees the instance healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        worker = next(w for w in cluster.status().workers if w.instance_id == victim.instance_id)
        if worker.healthy and worker.pids and worker.pids[0] != victim.pids[0]:
            break
        assert time.monotonic() < deadline, f"{victim.instance_id} not back: {worker}"
        time.sleep(0.2)
    while not cluster.serving():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)


def non_loopback_listeners(pids: list[int]) -> list[str]:
    return [address for address in listening_addresses(pids) if not is_loopback(address)]


@contextlib.contextmanager
def two_ray_nodes(num_cpus: int) -> Iterator[str]:
    """The address of a two-node Ray cluster on 127.0.0.1 (ray.cluster_utils.Cluster: `num_cpus`
    logical CPUs a node), labelled node_a and node_b as a real cluster labels its node groups,
    with a Ray temp dir of its own. Afterwards every process started meanwhile is gone (what is
    still running after 15 s is stopped by id, and fails the check)."""
    from ray.cluster_utils import Cluster

    other_pids = set(descendant_pids(os.getpid()))
    use_loopback_node_address()
    ray_temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-", dir="/tmp")  # short socket paths
    os.makedirs("/tmp/ray", exist_ok=True)  # cluster_utils writes its address there
    nodes = Cluster(initialize_head=False)
    try:
        nodes.add_node(
            num_cpus=num_cpus,
            resources={"node_a": 1},
            include_dashboard=False,
            node_ip_address="127.0.0.1",
            temp_dir=ray_temp_dir,
        )
        nodes.add_node(num_cpus=num_cpus, resources={"node_b": 1}, node_ip_address="127.0.0.1")
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        pids = sorted(set(descendant_pids(os.getpid())) - other_pids)
        nodes.shutdown()
        shutil.rmtree(ray_temp_dir, ignore_errors=True)
        deadline = time.monotonic() + 15
        while any(process_is_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in pids if process_is_running(pid)]
        kill_and_wait(left, timeout_s=5)
    assert left == [], f"still running after the nodes stopped: {left}"
