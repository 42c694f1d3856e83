"""KV-aware routing end to end: two colocated Workers (a tiny llama, float64) in the router's
process, a real router on 127.0.0.1 with the kv_aware policy. The router learns what each prefix
cache holds from the workers' own reports: a prefix cached before the router started (its first
report, a snapshot) attracts the prompts that share it, and a prefix the worker evicted stops
attracting them. Greedy outputs equal transformers' whether the prefix was cached or not, and
every pool is whole again at the end. A lost instance is forgotten, and its first report after
it is back is a snapshot (synthetic workers)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.handle import LocalHandle
from engine.block_pool import hash_prompt_blocks
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.prefix_index import PrefixIndex
from router.synthetic import SyntheticWorker
from router.worker_api import InstanceLoad, PrefixReport, TokenEvent, WorkerUnavailable
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.router.harness import RouterThread
from tests.workers.test_colocated import collect, request
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 24
MAX_TOKENS = 6
SHARED, TAIL, OTHER_TAIL = make_prompts((40, 3, 5), seed=11)  # SHARED: five full blocks
IDS = ("colocated-0", "colocated-1")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str) -> Iterator[tuple[RouterThread, dict[str, Worker]]]:
    engine = EngineConfig(
        model_dir=tiny_model_dir,
        dtype="float64",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        num_threads=1,
    )
    workers = {instance_id: Worker(WorkerConfig(engine), instance_id) for instance_id in IDS}
    # colocated-1 caches SHARED before the router exists: only its report can tell the router.
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    workers[IDS[1]].submit(request("warm", SHARED, params))
    collect(workers[IDS[1]].poll_events, ["warm"])
    config = RouterConfig(
        model_dir=tiny_model_dir,
        block_size=BLOCK_SIZE,
        prefill_policy="kv_aware",
        load_refresh_interval_s=0.02,
    )

    def make_handles():
        return [LocalHandle(i, Role.COLOCATED, workers[i]) for i in IDS], []

    try:
        with pytest.MonkeyPatch.context() as patch:
            # Only the first report is a snapshot: the eviction must come through as a change.
            patch.setattr("router.worker_pool.SNAPSHOT_INTERVAL_S", 3600.0)
            with RouterThread(config, make_handles) as server:
                yield server, workers
    finally:
        for worker in workers.values():
            worker.shutdown()


def _index(server: RouterThread) -> PrefixIndex:
    assert server.router is not None
    index = server.router.pool.prefix_index
    assert index is not None
    return index


def _generate(server: RouterThread, prompt: list[int]) -> pb.GenerateResponse:
    with grpc.insecure_channel(server.address) as channel:
        request = pb.GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        return pb_grpc.GenerationStub(channel).GenerateUnary(request, timeout=30)


def _idle(worker: Worker) -> bool:
    load = worker.load()
    return not load.num_waiting_requests and not load.num_running


def _wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_prompts_follow_the_prefix_a_worker_reports_and_leave_it_once_evicted(
    cluster: tuple[RouterThread, dict[str, Worker]], tiny_model_dir: str
) -> None:
    server, workers = cluster
    shared_blocks = hash_prompt_blocks(SHARED, BLOCK_SIZE)
    index = _index(server)
    assert index.matching_blocks(shared_blocks, IDS) == {IDS[0]: 0, IDS[1]: 5}  # the snapshot

    # Both instances idle: without the report the id would choose colocated-0.
    hit = _generate(server, SHARED + TAIL)
    assert hit.prefill_instance == IDS[1]
    assert hit.usage.cached_prompt_tokens == 40

    # colocated-1 evicts SHARED (a prompt that needs its whole pool, sent to it directly); its
    # reports take the prefix out of the index, and the next prompt goes by load: the id.
    (filler,) = make_prompts((NUM_KV_BLOCKS * BLOCK_SIZE - 1,), seed=12)
    workers[IDS[1]].submit(request("filler", filler, SamplingParams(max_tokens=1)))
    _wait_until(lambda: _idle(workers[IDS[1]]), "the filler ran")
    _wait_until(lambda: not index.matching_blocks(shared_blocks, IDS)[IDS[1]], "evicted")
    miss = _generate(server, SHARED + OTHER_TAIL)
    assert miss.prefill_instance == IDS[0] and miss.usage.cached_prompt_tokens == 0

    assert server.router is not None
    registry = server.router.metrics.registry
    labels = {"instance": IDS[1], "role": "colocated"}
    # the hit's 40 tokens (the warm-up and the filler found none), from its load reports
    _wait_until(
        lambda: registry.get_sample_value("pdserve:prefix_cache_hits_total", labels) == 40,
        "the hit in the metrics",
    )

    expected = hf_greedy(tiny_model_dir, [SHARED + TAIL, SHARED + OTHER_TAIL], MAX_TOKENS)
    assert [list(hit.token_ids), list(miss.token_ids)] == expected

    def pools_whole() -> bool:
        return all(w.load().num_free_blocks == NUM_KV_BLOCKS for w in workers.values())

    _wait_until(pools_whole, "every block is free")


class RecordingWorker(SyntheticWorker):
    """Records what each load call asked of the prefix cache; `dead`: every call fails."""

    dead = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.asked: list[PrefixReport] = []

    async def load(self, prefix: PrefixReport = PrefixReport.NONE) -> InstanceLoad:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        self.asked.append(prefix)
        return await super().load(prefix)

    async def poll_events(self, timeout_s: float) -> list[TokenEvent]:
        if self.dead:
            raise WorkerUnavailable(f"{self.instance_id} exited")
        return await super().poll_events(timeout_s)


def test_a_lost_instance_is_forgotten_and_its_next_report_is_a_snapshot(
    tiny_model_dir: str,
) -> None:
    worker = RecordingWorker("colocated-0", Role.COLOCATED)
    config = RouterConfig(
        model_dir=tiny_model_dir, prefill_policy="kv_aware", load_refresh_interval_s=0.02
    )
    with RouterThread(config, lambda: ([worker], [])) as server:
        index = _index(server)
        _wait_until(lambda: len(worker.asked) >= 3, "three load reports")
        assert worker.asked[0] is PrefixReport.SNAPSHOT
        assert set(worker.asked[1:]) == {PrefixReport.CHANGES}
        server.run(_call(lambda: index.expect("colocated-0", hash_prompt_blocks(SHARED, 8))))
        assert index.num_blocks("colocated-0") == 5
        worker.dead = True
        _wait_until(lambda: index.num_blocks("colocated-0") == 0, "the index forgot it")
        num_asked = len(worker.asked)
        worker.dead = False  # restarted: what it holds now comes whole
        _wait_until(lambda: len(worker.asked) > num_asked, "a report after the restart")
        assert worker.asked[num_asked] is PrefixReport.SNAPSHOT


async def _call(function: Callable[[], object]) -> object:
    """Run `function` on the router's loop, where the index is used."""
    return function()
