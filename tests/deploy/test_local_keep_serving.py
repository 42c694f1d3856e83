"""The plain-process cluster keeps serving under load with cancels: it outlives idle time past every timeout,
cancelled requests give back every KV block at once, and a worker that dies (or loses a TP rank)
is reported down, restarted, and serves again.

One cluster for the module: a prefill instance at TP=2 and two decode instances behind the real
router, with the TP group's collective timeout and the KV deadlines shortened to 2 s, so that an
idle pause longer than them shows what a 2-minute pause shows with the defaults.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb

from deploy.cli.client import RouterClient
from deploy.config.cluster_spec import ClusterSpec, build_cluster_spec
from deploy.config.serve_config import parse_config
from deploy.runtime.local.local_cluster import LocalCluster
from kv_transfer.config import KVTransferConfig
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model
from worker.protocol import ProcessIds

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

SHORT_S = 2.0  # the TP collective timeout and both KV deadlines
NUM_BLOCKS = 256
LONG_TOKENS = 400  # long enough to kill a TP rank while these streams decode


def short_timeouts_spec(model_dir: str) -> ClusterSpec:
    config = parse_config(
        {
            "model": model_dir,
            "prefill": {"instances": 1, "tensor_parallel_size": 2},
            "decode": {"instances": 2},
            "kv_cache": {"num_blocks": NUM_BLOCKS, "block_size": 8},
            "router": {"port": 0},
            "ray": {"enabled": False},
        }
    )
    spec = build_cluster_spec(config)
    assert spec.prefill is not None and spec.decode is not None
    kv = KVTransferConfig(transfer_timeout_s=SHORT_S, start_timeout_s=SHORT_S)
    prefill = replace(spec.prefill, engine=replace(spec.prefill.engine, tp_timeout_s=SHORT_S))
    return replace(
        spec, prefill=replace(prefill, kv_transfer=kv), decode=replace(spec.decode, kv_transfer=kv)
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model_dir = add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("keep"), "llama"))
    with LocalCluster(short_timeouts_spec(model_dir)) as cluster:
        cluster.start()
        yield cluster


def generate(client: RouterClient, prompt: str, request_id: str, max_tokens: int = 6) -> list[int]:
    request = pb.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, request_id=request_id
    )
    return [t for response in client.generate(request, timeout_s=60) for t in response.token_ids]


def free_blocks(cluster: LocalCluster) -> dict[str, int]:
    return {load.instance_id: load.num_free_blocks for load in cluster.status()}


def test_idle_past_every_timeout_then_serves_the_same_tokens(cluster: LocalCluster) -> None:
    with RouterClient(cluster.address) as client:
        # one request per decode instance: both pairs' KV channels formed before the pause
        before = [generate(client, "The quick brown fox", f"idle-a{i}") for i in range(2)]
        time.sleep(3 * SHORT_S)
        assert all(load.healthy for load in cluster.status())
        after = [generate(client, "The quick brown fox", f"idle-b{i}") for i in range(2)]
    assert after == before and len(before[0]) == 6


def test_cancels_at_every_stage_give_every_block_back_within_seconds(
    cluster: LocalCluster,
) -> None:
    start = {instance_id: NUM_BLOCKS for instance_id in ("prefill-0", "decode-0", "decode-1")}
    rng = random.Random(5)
    # 0 s: before the prefill; a few ms: reserving / prefilling / handing the KV off; 0.3 s:
    # decoding (40 tokens take longer than that here). Some run to the end. 16 at a time: the
    # point is every stage, not load (2 cores, and KV deadlines of SHORT_S in this module).
    delays = [0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, None]
    prompts = ["The quick brown fox " * rng.randint(1, 25) for _ in range(48)]

    def one(client: RouterClient, index: int) -> int | str:
        """The number of tokens of a stream that ended OK, or the status code's name."""
        request = pb.GenerateRequest(
            prompt=prompts[index], max_tokens=40, ignore_eos=True, request_id=f"cancel-{index}"
        )
        call = client._generation.Generate(request, timeout=60)
        delay = delays[index % len(delays)]
        if delay is not None:
            threading.Timer(delay, call.cancel).start()
        try:
            return sum(len(response.token_ids) for response in call)
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]

    with RouterClient(cluster.address) as client:
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(lambda index: one(client, index), range(len(prompts))))
        ended_at = time.monotonic()
        free = free_blocks(cluster)
        while free != start and time.monotonic() < ended_at + 3.0:
            time.sleep(0.1)
            free = free_blocks(cluster)
    assert free == start, f"blocks still held {time.monotonic() - ended_at:.1f} s after the end"
    never_cancelled = outcomes[len(delays) - 1 :: len(delays)]
    assert never_cancelled == [40] * len(never_cancelled)
    assert set(outcomes) <= {40, "CANCELLED"}, outcomes  # a cancel may come after the end


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds it took; fails the test past `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def healthy(cluster: LocalCluster) -> dict[str, bool]:
    return {load.instance_id: load.healthy for load in cluster.status()}


def routable(cluster: LocalCluster) -> set[str]:
    """The instances the router would pick now (read from the test thread: a snapshot)."""
    assert cluster.router is not None
    pool = cluster.router.pool
    return {state.instance_id for state in [*pool.prefill_candidates(), *pool.decode_candidates()]}


def test_streams_already_decoding_survive_a_prefill_tp_rank_s_death(cluster: LocalCluster) -> None:
    """The prefill driver notices its dead TP rank, errors what it still holds and exits; the
    streams that are decoding on the decode instances finish with every token all the same."""
    prompts = [f"The quick brown fox {word}" for word in ("jumps", "runs", "sleeps", "eats")]
    with RouterClient(cluster.address) as client:
        expected = [generate(client, p, f"long-ref{i}", LONG_TOKENS) for i, p in enumerate(prompts)]
        calls = [
            client.generate(_long_request(prompt, f"long-{i}"), timeout_s=120)
            for i, prompt in enumerate(prompts)
        ]
        received = [[*next(call).token_ids, *next(call).token_ids] for call in calls]  # decoding
        restarts = cluster.num_restarts.get("prefill-0", 0)
        rank_pid = cluster.workers["prefill-0"].call(ProcessIds())[-1]
        os.kill(rank_pid, signal.SIGKILL)
        for tokens, call in zip(received, calls, strict=True):
            tokens += [t for response in call for t in response.token_ids]
        assert received == expected
        wait_until(lambda: cluster.num_restarts.get("prefill-0") == restarts + 1, 90, "restart")
        wait_until(lambda: "prefill-0" in routable(cluster), 10, "the router using it again")


def _long_request(prompt: str, request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt, max_tokens=LONG_TOKENS, ignore_eos=True, request_id=request_id
    )


@pytest.mark.parametrize("instance_id", ["prefill-0", "decode-0"])
def test_a_killed_process_is_reported_down_restarted_and_serves_again(
    cluster: LocalCluster, instance_id: str
) -> None:
    """prefill-0: its TP rank 1 is killed (the driver notices and its process exits);
    decode-0: the worker process itself is killed."""
    with RouterClient(cluster.address) as client:
        expected = generate(client, "The quick brown fox", f"{instance_id}-before")
        restarts = cluster.num_restarts.get(instance_id, 0)
        pids = cluster.workers[instance_id].call(ProcessIds())
        os.kill(pids[-1], signal.SIGKILL)  # prefill: TP rank 1; decode (TP=1): the process
        wait_until(lambda: not healthy(cluster)[instance_id], 5, f"{instance_id} reported down")
        assert {i for i, ok in healthy(cluster).items() if not ok} == {instance_id}
        wait_until(lambda: cluster.num_restarts.get(instance_id) == restarts + 1, 90, "the restart")
        assert all(healthy(cluster).values())
        wait_until(lambda: instance_id in routable(cluster), 10, "the router using it again")
        assert not any(_running(pid) for pid in pids), "a process of the dead instance is left"
        for n in range(4):  # both decode instances, through the restarted instance
            assert generate(client, "The quick brown fox", f"{instance_id}-after{n}") == expected
    assert free_blocks(cluster) == dict.fromkeys(("prefill-0", "decode-0", "decode-1"), NUM_BLOCKS)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
