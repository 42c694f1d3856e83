"""Disaggregated serving end to end in real processes: a prefill instance at TP=2 over gloo (its
rank 1 spawned by the Executor) and decode instances, each a ProcessWorker; a relay does what the
router will. Greedy outputs equal engine.LLM's and transformers' token for token (float64), and
every pool returns to its starting free count after every scenario.

The processes are shared by the whole module (start-up dominates the time on 2 cores); every
test leaves the pools as it found them, which each test checks.
"""

from __future__ import annotations

import os
import signal

import pytest

from engine import LLM, EngineConfig, SamplingParams
from kv_transfer.config import KVTransferConfig
from kv_transfer.receiver import RANK_REPORT_GRACE_S
from kv_transfer.send_handle import SPLIT_MIN_BYTES_ENV
from tests.engine.test_llm import hf_greedy, make_prompts
from tests.workers.cluster import (
    Cluster,
    Relay,
    free_blocks,
    make_requests,
    process_is_running,
    wait_for,
    wait_for_event,
)
from worker.config import WorkerConfig
from worker.protocol import Abort, Load, ProcessIds, Reserve, Submit

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

BLOCK_SIZE = 8
PREFILL_TP = 2
DOOMED_TIMEOUT_S = 2.0  # the transfer deadline of the decode instance the last test kills
PROMPTS = make_prompts((5, 12, 19, 33, 40, 70, 100), seed=3)
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def engine_config(model_dir: str, **overrides: object) -> EngineConfig:
    kwargs: dict[str, object] = {"dtype": "float64", "block_size": BLOCK_SIZE, "num_kv_blocks": 128}
    kwargs.update(overrides)
    return EngineConfig(model_dir=model_dir, **kwargs)  # type: ignore[arg-type]


def reference(model_dir: str, prompts: list[list[int]], params: object) -> list[list[int]]:
    with LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=256) as llm:
        return [out.token_ids for out in llm.generate(prompts, params)]  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["same_node", "network"])
def cluster(tiny_model, request):
    """The layout once per KV transport (both in this suite's NCCL-like ordered matching).
    Same-node: every transfer splits its copy (the prefill rank writes half of the blocks into
    the decode rank's cache), as large ones do; this model's transfers are far under the size."""
    model_dir = tiny_model("llama")
    transport = request.param
    # Chunks of 16 under a budget of 16: one chunk per step, so a long prompt takes many steps
    # (the abort tests catch requests queued behind it and mid-prefill).
    prefill = WorkerConfig.prefill(
        engine_config(
            model_dir, tensor_parallel_size=PREFILL_TP, chunk_size=16, max_num_batched_tokens=16
        ),
        KVTransferConfig(transport=transport),  # "network": the prefill never shares its cache
    )
    decode_kv = KVTransferConfig(transfer_timeout_s=10.0, transport=transport)
    specs = [
        ("prefill", prefill),
        ("decode-0", WorkerConfig.decode(engine_config(model_dir), decode_kv)),
        ("decode-1", WorkerConfig.decode(engine_config(model_dir), decode_kv)),
        (
            "decode-small",
            WorkerConfig.decode(engine_config(model_dir, num_kv_blocks=16), decode_kv),
        ),
        (
            "decode-tp2",
            WorkerConfig.decode(engine_config(model_dir, tensor_parallel_size=2), decode_kv),
        ),
        (
            "decode-doomed",
            WorkerConfig.decode(
                engine_config(model_dir),
                KVTransferConfig(transfer_timeout_s=DOOMED_TIMEOUT_S, transport=transport),
            ),
        ),
    ]
    cluster = Cluster()
    try:
        with pytest.MonkeyPatch.context() as patch:  # the worker processes inherit it
            if transport == "same_node":
                patch.setenv(SPLIT_MIN_BYTES_ENV, "0")
            cluster.start(specs)
        cluster.model_dir = model_dir  # type: ignore[attr-defined]
        cluster.transport = transport  # type: ignore[attr-defined]
        cluster.start_free = {i: free_blocks(cluster, i) for i in cluster.workers}  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.shutdown()
        for worker in list(cluster.workers.values()):
            worker.kill()
        wait_for(
            lambda: not any(process_is_running(pid) for pid in cluster.process_ids),
            15.0,
            "every worker process (and the prefill's TP rank) exiting",
        )


def shared_memory_of(pid: int) -> list[str]:
    """The torch shared-memory segments process `pid` holds open (its cache, once exported)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return [target for target in targets if target.startswith("/dev/shm/torch_")]


def assert_pools_back(cluster: Cluster, instance_ids: list[str], timeout_s: float = 15.0) -> None:
    for instance_id in instance_ids:
        start = cluster.start_free[instance_id]  # type: ignore[attr-defined]
        wait_for(
            lambda i=instance_id, n=start: free_blocks(cluster, i) == n,
            timeout_s,
            f"{instance_id} back to {start} free blocks",
        )


def test_greedy_outputs_equal_llm_and_transformers(cluster) -> None:
    model_dir = cluster.model_dir
    expected = reference(model_dir, PROMPTS, GREEDY)
    assert expected == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    # The same prompts again, ending on stop ids (at the first token: on the prefill side; and
    # mid-way: on the decode side) and on max_tokens=1.
    ref0 = expected[0]
    stopping = [
        SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(ref0[0],)),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(expected[2][6],)),
    ]
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [GREEDY] * len(PROMPTS) + stopping
    expected_all = reference(model_dir, prompts, params)
    assert expected_all[-3:] == [
        [ref0[0]],
        [expected[1][0]],
        expected[2][: 1 + expected[2].index(expected[2][6])],
    ]

    relay = Relay(cluster, "prefill", ["decode-0", "decode-1"], PREFILL_TP)
    results = relay.run(make_requests(prompts, params, "e2e"))
    outputs = [r.token_ids for r in results.values()]
    assert outputs == expected_all
    reasons = [r.finish_reason for r in results.values()]
    assert reasons == ["length"] * len(PROMPTS) + ["stop", "length", "stop"]
    for result in results.values():  # the first token from the prefill, the rest from a decode
        assert len(result.first_token_ids) == 1
        assert set(result.decode_sources) <= {"decode-0", "decode-1"}
    used = {source for r in results.values() for source in r.decode_sources}
    assert used == {"decode-0", "decode-1"}
    assert_pools_back(cluster, ["prefill", "decode-0", "decode-1"])
    # The same-node transport shared each prefill rank's cache through /dev/shm; the network
    # one never did.
    prefill_pids = cluster.workers["prefill"].call(ProcessIds())
    assert len(prefill_pids) == PREFILL_TP
    exported = [bool(shared_memory_of(pid)) for pid in prefill_pids]
    assert exported == [cluster.transport == "same_node"] * PREFILL_TP
    # ... and each decode rank's, which the prefill ranks wrote their share into
    decode_pids = [
        pid for d in ("decode-0", "decode-1") for pid in cluster.workers[d].call(ProcessIds())
    ]
    assert [bool(shared_memory_of(pid)) for pid in decode_pids] == [
        cluster.transport == "same_node"
    ] * len(decode_pids)


def test_decode_instance_at_tp2_equals_llm(cluster) -> None:
    """Prefill TP=2 -> decode TP=2: each decode rank receives its KV heads from its peer rank."""
    prompts = PROMPTS[:4]
    expected = reference(cluster.model_dir, prompts, GREEDY)
    relay = Relay(cluster, "prefill", ["decode-tp2"], PREFILL_TP)
    results = relay.run(make_requests(prompts, GREEDY, "tp2"))
    assert [r.token_ids for r in results.values()] == expected
    assert {s for r in results.values() for s in r.decode_sources} == {"decode-tp2"}
    assert_pools_back(cluster, ["prefill", "decode-tp2"])


@pytest.mark.parametrize("chunk_size", [16, 64, 256])
def test_chunked_prefill_equals_unchunked(cluster, chunk_size: int) -> None:
    prompts = make_prompts((300, 130, 45, 17), seed=7)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = reference(cluster.model_dir, prompts, params)  # one chunk per prompt (512)
    instance_id = f"prefill-chunk{chunk_size}"
    config = engine_config(cluster.model_dir, chunk_size=chunk_size, max_num_batched_tokens=256)
    cluster.start([(instance_id, WorkerConfig.prefill(config))])
    try:
        relay = Relay(cluster, instance_id, ["decode-0", "decode-1"], 1)
        results = relay.run(make_requests(prompts, params, f"chunk{chunk_size}"))
        assert [r.token_ids for r in results.values()] == expected
    finally:
        cluster.stop_worker(instance_id)
    assert_pools_back(cluster, ["decode-0", "decode-1"])


def test_prefix_cache_hit_equals_miss_and_counts_skipped_tokens(cluster) -> None:
    prompt = make_prompts((41,), seed=11)[0]
    expected = reference(cluster.model_dir, [prompt], GREEDY)[0]
    relay = Relay(cluster, "prefill", ["decode-0"], PREFILL_TP)

    def hit_tokens() -> float:
        return relay.worker("prefill").call(Load()).details.num_prefix_hit_tokens

    before = hit_tokens()
    miss = relay.run(make_requests([prompt], GREEDY, "miss"))["miss-0"]
    after_miss = hit_tokens()
    hit = relay.run(make_requests([prompt], GREEDY, "hit"))["hit-0"]
    after_hit = hit_tokens()
    assert miss.token_ids == hit.token_ids == expected
    assert after_miss == before
    assert after_hit - after_miss == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 40 skipped
    # ... and the first token's timings say so (the request left the prefill's scheduler in
    # the step that computed it, not after it, which would read 0)
    assert (miss.num_cached_tokens, hit.num_cached_tokens) == (0, 40)
    assert relay.worker("prefill").call(Load()).prefix_cache_hit_rate > 0
    assert_pools_back(cluster, ["prefill", "decode-0"])


def test_small_decode_pool_preempts_and_outputs_stay_identical(cluster) -> None:
    # 4 prompts of 20 tokens growing to 60: 3 blocks each to reserve, 8 each at the end,
    # 32 in all for a pool of 16 (each alone fits).
    prompts = make_prompts((20, 20, 20, 20), seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(cluster.model_dir, prompts, params)
    relay = Relay(cluster, "prefill", ["decode-small"], PREFILL_TP)
    preemptions_before = relay.worker("decode-small").call(Load()).num_preemptions
    results = relay.run(make_requests(prompts, params, "small"))
    assert [r.token_ids for r in results.values()] == expected
    assert relay.worker("decode-small").call(Load()).num_preemptions > preemptions_before
    assert_pools_back(cluster, ["prefill", "decode-small"])


def test_abort_queued_and_mid_prefill_frees_every_pool(cluster) -> None:
    relay = Relay(cluster, "prefill", ["decode-0"], PREFILL_TP)
    prefill, decode = relay.worker("prefill"), relay.worker("decode-0")
    long_prompt, short_prompt = make_prompts((400, 10), seed=21)
    for attempt in range(5):  # the stages depend on timing; retry until both were hit
        requests = make_requests([long_prompt, short_prompt], GREEDY, f"abort{attempt}")
        for request in requests:
            ticket = decode.call(Reserve(request, "prefill", PREFILL_TP))
            prefill.call(Submit(request, ticket))
        # The short prompt waits behind the long one (one 16-token chunk per step, first come
        # first served); the long one is mid-prefill for 25 steps.
        stages = [prefill.call(Abort(request.request_id)) for request in reversed(requests)]
        for request in requests:  # the router aborts everywhere
            decode.call(Abort(request.request_id))
        assert_pools_back(cluster, ["prefill", "decode-0"])
        if stages == ["queued", "prefilling"]:
            break
    assert stages == ["queued", "prefilling"]


def test_abort_mid_transfer_frees_every_pool(cluster) -> None:
    relay = Relay(cluster, "prefill", ["decode-1"], PREFILL_TP)
    prefill, decode = relay.worker("prefill"), relay.worker("decode-1")
    (request,) = make_requests(make_prompts((40,), seed=31), GREEDY, "transfer")
    relay.expect(request.request_id, "decode-1")
    ticket = decode.call(Reserve(request, "prefill", PREFILL_TP))
    os.kill(decode.pid, signal.SIGSTOP)  # the decode side cannot take the KV: it stays in flight
    try:
        prefill.call(Submit(request, ticket))
        wait_for_event(relay, "prefill", lambda r: bool(r.token_ids), request.request_id)
        assert free_blocks(cluster, "prefill") < cluster.start_free["prefill"]  # held by the send
        assert prefill.call(Abort(request.request_id)) == "sending"
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    assert decode.call(Abort(request.request_id)) in ("receiving", "decoding", None)
    assert_pools_back(cluster, ["prefill", "decode-1"])


def test_abort_while_decoding_frees_every_pool(cluster) -> None:
    relay = Relay(cluster, "prefill", ["decode-0"], PREFILL_TP)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    (request,) = make_requests(make_prompts((30,), seed=41), params, "decoding")
    assert relay.dispatch(request)
    wait_for_event(relay, "decode-0", lambda r: len(r.token_ids) > 3, request.request_id)
    assert relay.worker("decode-0").call(Abort(request.request_id)) == "decoding"
    relay.worker("prefill").call(Abort(request.request_id))  # the router aborts everywhere
    result = wait_for_event(relay, "decode-0", lambda r: r.done, request.request_id)
    assert result.finish_reason == "abort"
    assert_pools_back(cluster, ["prefill", "decode-0"])


def test_killed_decode_mid_transfer_releases_prefill_blocks_within_deadline(cluster) -> None:
    relay = Relay(cluster, "prefill", ["decode-doomed"], PREFILL_TP)
    prefill, doomed = relay.worker("prefill"), relay.worker("decode-doomed")
    (request,) = make_requests(make_prompts((40,), seed=51), GREEDY, "doomed")
    relay.expect(request.request_id, "decode-doomed")
    ticket = doomed.call(Reserve(request, "prefill", PREFILL_TP))
    os.kill(doomed.pid, signal.SIGSTOP)  # the KV stays in flight ...
    prefill.call(Submit(request, ticket))
    wait_for_event(relay, "prefill", lambda r: bool(r.token_ids), request.request_id)
    assert free_blocks(cluster, "prefill") < cluster.start_free["prefill"]
    os.kill(doomed.pid, signal.SIGKILL)  # ... until the decode process dies
    cluster.workers.pop("decode-doomed").kill()
    deadline_s = DOOMED_TIMEOUT_S + RANK_REPORT_GRACE_S  # the latest the prefill may notice
    wait_for(
        lambda: free_blocks(cluster, "prefill") == cluster.start_free["prefill"],
        deadline_s + 2.0,
        "the prefill releasing the blocks of the dead decode's transfer",
    )
    # The hand-off failed on the prefill side: it ends the request with an error.
    result = wait_for_event(relay, "prefill", lambda r: r.done, request.request_id)
    assert result.finish_reason == "error"
    assert "decode-doomed" in (result.error or "")
