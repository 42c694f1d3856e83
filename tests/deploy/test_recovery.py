"""Requests survive a dead worker, on real processes killed with real signals (plain processes;
the Ray runtime's decode kill is in test_ray_cluster.py):

- streams on a decode instance that is SIGKILLed mid-stream migrate to the other one and finish
  token for token what transformers generates;
- requests sent to a prefill instance that is stopped and then SIGKILLed before their first
  token wait for its restart and are served there, all the same;
- streams under a grammar do both and still match it, token for token as undisturbed: the
  prefill instance that takes a migrated stream resumes the grammar from its earlier output.

Every pool is back to its start count afterwards. One cluster for the module: a prefill
instance at TP=2 and two decode instances, float64 (parity with transformers is exact).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.local.local_cluster import LocalCluster
from router.tokenizer import RouterTokenizer
from tests.deploy.ray_support import hf_greedy, make_prompts, serve_spec, tiny_model_with_tokenizer
from worker.protocol import ProcessIds

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

NUM_BLOCKS = 256
LONG_TOKENS = 300  # long enough to kill a decode instance while these stream
LONG_PROMPTS = make_prompts((9, 14, 5, 11, 20, 7), seed=4)
SHORT_TOKENS = 8
SHORT_PROMPTS = make_prompts((6, 13, 21, 4), seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("recovery"))


@pytest.fixture(scope="module")
def cluster(model_dir: str) -> Iterator[LocalCluster]:
    spec = serve_spec(
        model_dir,
        dtype="float64",
        prefill={"tensor_parallel_size": 2},
        decode={"instances": 2},
        kv_cache={"block_size": 8, "num_blocks": NUM_BLOCKS},
        # A reservation whose prefill instance died waits out start + transfer deadline (a
        # posted gloo receive cannot be withdrawn): 60 + 5 s by default, 8 + 5 s here.
        kv_transfer={"transfer_timeout_s": 5.0, "start_timeout_s": 8.0},
        router={"worker_timeout_s": 5.0, "shutdown_grace_s": 1.0},
        ray={"enabled": False},
    )
    with LocalCluster(spec) as running:
        running.start()
        yield running


@dataclass
class Stream:
    token_ids: list[int] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    last: pb.GenerateResponse | None = None


# a long output that only a grammar resumed at the right place keeps matching
LETTERS = "[a-z ]{300}"
CONSTRAINED = pb.StructuredOutput(regex=LETTERS)
CONSTRAINED_TOKENS = 480  # room for 300 characters, within the model length of 512


def _request(prompt: list[int], max_tokens: int, constrained: bool) -> pb.GenerateRequest:
    if constrained:
        return pb.GenerateRequest(
            token_ids=prompt, max_tokens=max_tokens, structured_output=CONSTRAINED
        )
    return pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)


def _stream(
    address: str, prompt: list[int], max_tokens: int, started: list[int], constrained=False
) -> Stream:
    result = Stream()
    request = _request(prompt, max_tokens, constrained)
    with grpc.insecure_channel(address) as channel:
        try:
            for message in pb_grpc.GenerationStub(channel).Generate(request, timeout=120):
                if not result.token_ids:
                    started.append(1)
                result.token_ids.extend(message.token_ids)
                result.last = message
        except grpc.RpcError as error:
            result.code, result.details = error.code(), error.details() or ""
    return result


def _start_all(
    cluster: LocalCluster, prompts: list[list[int]], max_tokens: int, constrained: bool = False
):
    results: list[Stream] = [Stream() for _ in prompts]
    started: list[int] = []

    def run(index: int) -> None:
        address = cluster.address
        results[index] = _stream(address, prompts[index], max_tokens, started, constrained)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    return results, started, threads


def _wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def _all_back(cluster: LocalCluster) -> bool:
    loads = cluster.status()
    return len(loads) == 3 and all(
        load.healthy and load.num_free_blocks == NUM_BLOCKS for load in loads
    )


def _kill_the_busiest_decode(cluster: LocalCluster, started, threads, num_streams: int) -> str:  # type: ignore[no-untyped-def]
    """Once every stream started, SIGKILL the decode instance holding the most of them, at once
    (they run in seconds); the streams are joined. Returns the victim's id."""
    _wait_until(lambda: len(started) == num_streams, 60, "every stream started")
    loads = {load.instance_id: load for load in cluster.status()}
    victim = max(("decode-0", "decode-1"), key=lambda i: loads[i].num_running)
    assert loads[victim].num_running > 0, loads
    os.kill(cluster.workers[victim].pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    return victim


def test_streams_on_a_killed_decode_instance_migrate_and_equal_transformers(
    cluster: LocalCluster, model_dir: str
) -> None:
    expected = hf_greedy(model_dir, LONG_PROMPTS, LONG_TOKENS)
    results, started, threads = _start_all(cluster, LONG_PROMPTS, LONG_TOKENS)
    victim = _kill_the_busiest_decode(cluster, started, threads, len(LONG_PROMPTS))
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == expected
    migrated = [r.last.timings for r in results if r.last and r.last.timings.migrations]
    assert migrated, f"{victim} held none of the streams"
    for timings in migrated:
        assert timings.recovery_s > 0
        stages = (
            timings.router_queue_s
            + timings.prefill_queue_s
            + timings.prefill_s
            + timings.kv_transfer_s
            + timings.decode_queue_s
            + timings.decode_s
            + timings.recovery_s
        )
        assert stages == pytest.approx(timings.e2e_s, abs=0.05)
    for result in results:  # a migrated stream finished on the other decode instance
        assert result.last is not None
        if result.last.timings.migrations:
            assert result.last.decode_instance != victim
    _wait_until(lambda: _all_back(cluster), 120, "the restart, every block back")


def test_requests_on_a_prefill_killed_before_their_first_token_wait_for_its_restart(
    cluster: LocalCluster, model_dir: str
) -> None:
    expected = hf_greedy(model_dir, SHORT_PROMPTS, SHORT_TOKENS)
    _wait_until(lambda: _all_back(cluster), 120, "a healthy cluster")
    driver_pid = cluster.workers["prefill-0"].pid
    restarts = cluster.num_restarts.get("prefill-0", 0)
    os.kill(driver_pid, signal.SIGSTOP)  # the requests reach it and wait there
    results, started, threads = _start_all(cluster, SHORT_PROMPTS, SHORT_TOKENS)
    time.sleep(1.0)
    assert not started
    os.kill(driver_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert cluster.num_restarts.get("prefill-0") == restarts + 1
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == expected
    assert all(r.last is not None and r.last.timings.retries >= 1 for r in results)
    assert cluster.workers["prefill-0"].call(ProcessIds())[0] != driver_pid
    # The reservations made for the dead incarnation end at their deadline.
    _wait_until(lambda: _all_back(cluster), 60, "every block back")


def _undisturbed(cluster: LocalCluster, prompts: list[list[int]], max_tokens: int):
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return [
            list(stub.GenerateUnary(_request(p, max_tokens, True), timeout=120).token_ids)
            for p in prompts
        ]


def _matches_the_grammar(tokenizer, token_ids: list[int]) -> bool:
    return re.fullmatch(LETTERS, tokenizer.decode(token_ids)) is not None


def test_constrained_streams_migrate_and_retry_under_their_grammar(
    cluster: LocalCluster, model_dir: str
) -> None:
    tokenizer = RouterTokenizer(model_dir)
    _wait_until(lambda: _all_back(cluster), 120, "a healthy cluster")
    expected = _undisturbed(cluster, LONG_PROMPTS, CONSTRAINED_TOKENS)
    assert all(_matches_the_grammar(tokenizer, ids) for ids in expected)
    assert min(len(ids) for ids in expected) > 100  # long enough to be cut by the kill
    # mid-output: the decode instance holding the most streams dies
    results, started, threads = _start_all(cluster, LONG_PROMPTS, CONSTRAINED_TOKENS, True)
    _kill_the_busiest_decode(cluster, started, threads, len(LONG_PROMPTS))
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == expected
    assert any(r.last and r.last.timings.migrations for r in results)
    _wait_until(lambda: _all_back(cluster), 120, "the restart, every block back")
    # before the first token: the prefill instance stops, then dies
    driver_pid = cluster.workers["prefill-0"].pid
    os.kill(driver_pid, signal.SIGSTOP)
    short = LONG_PROMPTS[:3]
    results, started, threads = _start_all(cluster, short, CONSTRAINED_TOKENS, True)
    time.sleep(1.0)
    assert not started
    os.kill(driver_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert [(r.code, r.details) for r in results] == [(grpc.StatusCode.OK, "")] * len(results)
    assert [r.token_ids for r in results] == expected[:3]
    assert all(r.last is not None and r.last.timings.retries >= 1 for r in results)
    _wait_until(lambda: _all_back(cluster), 60, "every block back")
