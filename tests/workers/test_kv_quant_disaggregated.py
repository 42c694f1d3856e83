"""Disaggregated serving with an 8-bit KV cache, in real processes: every (prefill TP, decode TP)
pair in {1, 2} x {1, 2} hands quantized KV and its scales over, re-sharded by heads, and decodes
token for token what engine.LLM with the same kv_cache_dtype produces (float64); a decode
instance whose cache stores another dtype is refused with both dtypes named; every pool returns
to its starting free count.

One cluster per dtype: int8 over the network transport (gloo), fp8_e4m3 over the same-node one.
"""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from kv_transfer.config import KVTransferConfig
from tests.engine.test_llm import make_prompts
from tests.workers.cluster import Cluster, Relay, free_blocks, make_requests, wait_for
from worker.config import WorkerConfig
from worker.protocol import Abort, Reserve, Submit

pytestmark = pytest.mark.slow  # starts worker processes

BLOCK_SIZE = 8
PROMPTS = make_prompts((5, 19, 40), seed=5)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
TRANSPORT = {"int8": "network", "fp8_e4m3": "same_node"}


def engine_config(model_dir: str, kv_dtype: str, tp: int) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        dtype="float64",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_dtype,
    )


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def cluster(tiny_model, request):
    model_dir = tiny_model("llama")  # 2 KV heads: TP 2 splits them, one per rank
    kv_dtype = request.param
    kv = KVTransferConfig(transfer_timeout_s=20.0, transport=TRANSPORT[kv_dtype])
    specs = [
        (f"prefill-{tp}", WorkerConfig.prefill(engine_config(model_dir, kv_dtype, tp), kv))
        for tp in (1, 2)
    ]
    specs += [
        (f"decode-{tp}", WorkerConfig.decode(engine_config(model_dir, kv_dtype, tp), kv))
        for tp in (1, 2)
    ]
    specs.append(("decode-auto", WorkerConfig.decode(engine_config(model_dir, "auto", 1), kv)))
    cluster = Cluster()
    try:
        cluster.start(specs)
        cluster.kv_dtype = kv_dtype  # type: ignore[attr-defined]
        cluster.model_dir = model_dir  # type: ignore[attr-defined]
        cluster.start_free = {i: free_blocks(cluster, i) for i in cluster.workers}  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.shutdown()
        for worker in list(cluster.workers.values()):
            worker.kill()


def assert_pools_back(cluster: Cluster) -> None:
    start_free: dict[str, int] = cluster.start_free  # type: ignore[attr-defined]
    for instance_id, start in start_free.items():

        def back(i: str = instance_id, n: int = start) -> bool:
            return free_blocks(cluster, i) == n

        wait_for(back, 15.0, f"{instance_id} back to {start} free blocks")


def test_every_tp_pair_decodes_what_llm_does(cluster) -> None:
    with LLM(
        cluster.model_dir,
        dtype="float64",
        block_size=BLOCK_SIZE,
        num_kv_blocks=128,
        kv_cache_dtype=cluster.kv_dtype,
    ) as llm:
        expected = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    with LLM(cluster.model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=128) as llm:
        unquantized = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert expected != unquantized  # 8 bits change this random model's near-tied choices
    for prefill_tp in (1, 2):
        for decode_tp in (1, 2):
            relay = Relay(cluster, f"prefill-{prefill_tp}", [f"decode-{decode_tp}"], prefill_tp)
            results = relay.run(make_requests(PROMPTS, GREEDY, f"p{prefill_tp}d{decode_tp}"))
            assert [r.token_ids for r in results.values()] == expected, (prefill_tp, decode_tp)
            assert {s for r in results.values() for s in r.decode_sources} == {
                f"decode-{decode_tp}"
            }
            assert_pools_back(cluster)


def test_a_dtype_mismatch_is_refused_naming_both(cluster) -> None:
    request = make_requests(PROMPTS[:1], GREEDY, "mismatch")[0]
    ticket = cluster.workers["decode-auto"].call(Reserve(request, "prefill-1", 1))
    assert ticket.kv_cache_dtype == "auto"
    with pytest.raises(Exception, match="kv_cache dtype mismatch") as refused:
        cluster.workers["prefill-1"].call(Submit(request, ticket))
    assert "'auto'" in str(refused.value) and repr(cluster.kv_dtype) in str(refused.value)
    cluster.workers["decode-auto"].call(Abort(request.request_id))  # as the router would
    assert_pools_back(cluster)
