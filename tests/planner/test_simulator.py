"""The simulator against timelines computed by hand (times in ms)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from planner import metrics
from planner.attainment import joint_attainment, to_records
from planner.latency import StepModel
from planner.profile import TPProfile
from planner.sim_spec import InstanceSpec, LinkSpec, SimOptions
from planner.simulator import Simulator

NO_OVERHEAD = (0.0, 0.0)


def _spec(prefill=(10.0, 1.0, 0.0), decode=(5.0, 0.0, 0.0), pp=1, capacity=None, node=0):
    profile = TPProfile(prefill, decode, decode, overhead=NO_OVERHEAD)
    return InstanceSpec(StepModel(profile, pp), 1, capacity, node)


def test_disaggregated_timeline_two_requests() -> None:
    # A prefill stage is a + b*Σl + c*Σl² plus DistServe's pp constant (1 ms at pp = 1).
    # r0 at 0 (prompt 10, 3 tokens): prefill 10 + 10 + 1 = 21 -> first token at 21; two decode
    # steps of 5 ms -> 31. r1 at 5 (prompt 20, 2 tokens) waits for the prefill instance:
    # 21 -> 21 + 10 + 20 + 1 = 52, one decode step -> 57.
    result = Simulator([10, 20], [3, 2], [0.0, 5.0], prefill=[_spec()], decode=[_spec()]).run()
    assert result.ttft_ms.tolist() == [21.0, 47.0]
    assert result.tpot_ms.tolist() == [5.0, 5.0]


def test_a_reservation_waits_for_the_decode_step_under_way() -> None:
    # r0 at 0 (prompt 10, 4 tokens): prefill 0 -> 21, decode steps 21-26, 26-31, 31-36. r1 at
    # 23 (prompt 10, 2 tokens): DistServe's model prefills it at once (23 -> 44, TTFT 21);
    # pdserve's dispatch first reserves on the decode instance, whose loop is in its 21-26
    # step, so r1 joins the prefill queue at 26 (26 -> 47, TTFT 24).
    def run(reserve: bool) -> list[float]:
        options = SimOptions(reserve_before_prefill=reserve)
        simulator = Simulator(
            [10, 10], [4, 2], [0.0, 23.0], prefill=[_spec()], decode=[_spec()], options=options
        )
        return simulator.run().ttft_ms.tolist()

    assert run(False) == [21.0, 21.0]
    assert run(True) == [21.0, 24.0]


def test_kv_transfer_is_priced_on_a_fifo_link() -> None:
    # 1 MB per token over 1 GB/s = 1 ms per token, plus 1 ms per message; both prompts of 10
    # tokens end their prefill together at 10 + 20 + 1 = 31 (one batch), so the second
    # transfer waits for the first: arrivals at 42 and 53 (different nodes use the cross link).
    link = LinkSpec(
        bytes_per_token=1e6, intra_node_GBps=100.0, cross_node_GBps=1.0, per_message_ms=1.0
    )
    result = Simulator(
        [10, 10], [2, 2], [0.0, 0.0], prefill=[_spec()], decode=[_spec(node=1)], link=link
    ).run()
    assert result.ttft_ms.tolist() == [31.0, 31.0]
    # r0 lands at 42 and steps 42 -> 47; r1 lands at 53 and steps 53 -> 58.
    assert result.tpot_ms.tolist() == [16.0, 27.0]
    assert result.transfer_ms_total == pytest.approx(22.0)


def test_decode_batch_cost_uses_contexts_and_batch_size() -> None:
    # Decode a + b*Σ(ctx+1) + c*B with (1, 0.1, 2): one prefill batch 10 + 30 + 1 = 41, then
    # one step with contexts 10 and 20: 1 + 0.1*(11 + 21) + 2*2 = 8.2.
    decode = _spec(decode=(1.0, 0.1, 2.0))
    result = Simulator([10, 20], [2, 2], [0.0, 0.0], prefill=[_spec()], decode=[decode]).run()
    assert result.ttft_ms.tolist() == [41.0, 41.0]
    assert result.tpot_ms.tolist() == pytest.approx([8.2, 8.2])


def test_pipeline_prefill_stages_and_distserve_counting() -> None:
    # pp = 2: each stage takes (10 + 30)/2 + 2 = 22, so the first token is at 44. In DistServe's
    # counting a request of 2 output tokens decodes 2 steps after its prefill: TPOT = 10/2.
    options = SimOptions(distserve_compat=True)
    result = Simulator(
        [30], [2], [0.0], prefill=[_spec(pp=2)], decode=[_spec()], options=options
    ).run()
    assert result.ttft_ms.tolist() == [44.0]
    assert result.tpot_ms.tolist() == [5.0]


def test_chunked_colocated_step_mixes_a_chunk_with_decodes() -> None:
    # chunk_size 8: prompt 12 goes 8 then 4. Step 1: a + b*8 + c*64 = 10 + 8 = 18.
    # Step 2: chunk of 4 after 8 cached: 10 + 4 = 14 -> first token at 32, then one decode step
    # of 5 -> 37.
    options = SimOptions(colocated_policy="chunked", chunk_size=8, max_num_batched_tokens=8)
    result = Simulator([12], [2], [0.0], colocated=[_spec()], options=options).run()
    assert result.ttft_ms.tolist() == [32.0]
    assert result.tpot_ms.tolist() == [5.0]


def test_a_measured_mixed_step_prices_the_chunk_with_its_own_triple() -> None:
    # Decodes: b*Σ(ctx+1) + c*B = 0.01*(100 + 2) + 1*2 = 3.02. The chunk of 8 after 4 cached:
    # without a measured triple, max(prefill a 10, decode a 5) + 1*8 + 0 = 18 -> 21.02; with
    # chunked_prefill (30, 2, 0.5): 30 + 2*8 + 0.5*(64 + 64) = 110 -> 113.02.
    plain = TPProfile((10.0, 1.0, 0.0), (5.0, 0.01, 1.0), (5.0, 0.01, 1.0))
    assert StepModel(plain).mixed_ms(2, 100, 8, 128) == pytest.approx(21.02)
    measured = TPProfile(
        (10.0, 1.0, 0.0), (5.0, 0.01, 1.0), (5.0, 0.01, 1.0), chunked_prefill=(30.0, 2.0, 0.5)
    )
    assert StepModel(measured).mixed_ms(2, 100, 8, 128) == pytest.approx(113.02)
    assert StepModel(measured).mixed_ms(0, 0, 8, 128) == pytest.approx(18.0)  # chunks alone


def test_colocated_placement_counts_a_prompt_until_its_first_token() -> None:
    # Two replicas, chunk 8. r0 (prompt 24) arrives at 0 on replica A: chunks 0-18, 18-36,
    # 36-54 (first token at 54). r1 (prompt 8) at 1: A has r0's 24 prompt tokens still to
    # prefill (pdserve's least_tokens), B none, so B prefills it at once: 1 -> 19, TTFT 18.
    # Counting only A's queue (empty once r0's first chunk started) would tie and put r1 on A.
    options = SimOptions(colocated_policy="chunked", chunk_size=8, max_num_batched_tokens=8)
    result = Simulator(
        [24, 8], [1, 1], [0.0, 1.0], colocated=[_spec(), _spec()], options=options
    ).run()
    assert result.ttft_ms.tolist() == [54.0, 18.0]


def test_vllm_policy_runs_a_queued_prompt_before_decoding() -> None:
    # r0: prefill 0 -> 21, decode step 21 -> 26; r1 arrives at 22 and is prefilled at 26 -> 57
    # before r0's second decode step (57 -> 62, both decode together: a = 5).
    result = Simulator([10, 20], [3, 2], [0.0, 22.0], colocated=[_spec()]).run()
    assert result.ttft_ms.tolist() == [21.0, 35.0]
    assert result.tpot_ms.tolist() == [20.5, 5.0]


def test_kv_memory_preempts_and_every_request_finishes() -> None:
    rng = random.Random(1)
    prompts = [rng.randint(50, 100) for _ in range(40)]
    outputs = [rng.randint(20, 60) for _ in range(40)]
    arrivals = [float(i) for i in range(40)]
    result = Simulator(
        prompts,
        outputs,
        arrivals,
        prefill=[_spec(prefill=(1.0, 0.01, 0.0))],
        decode=[_spec(capacity=400)],
    ).run()
    assert result.num_preemptions > 0
    assert np.isfinite(result.ttft_ms).all() and np.isfinite(result.tpot_ms).all()


def test_attainment_agrees_with_the_benchmark_metric_code() -> None:
    rng = random.Random(2)
    n = 300
    prompts = [rng.randint(20, 400) for _ in range(n)]
    outputs = [rng.randint(1, 80) for _ in range(n)]
    arrivals = sorted(rng.uniform(0, 3000) for _ in range(n))
    result = Simulator(
        prompts, outputs, arrivals, prefill=[_spec(prefill=(5.0, 0.05, 0.0))], decode=[_spec()]
    ).run()
    records = to_records(result)
    for ttft_ms, tpot_ms in [(50.0, 6.0), (200.0, 5.5), (1e9, 1e9)]:
        expected = metrics.attainment(records, metrics.SLOs.single(ttft_ms / 1000, tpot_ms / 1000))
        assert joint_attainment(result, ttft_ms, tpot_ms) == pytest.approx(expected)


def test_ten_thousand_requests_simulate_quickly() -> None:
    rng = random.Random(3)
    n = 10_000
    prompts = [rng.randint(50, 1500) for _ in range(n)]
    outputs = [rng.randint(10, 400) for _ in range(n)]
    arrivals = [i * 200.0 for i in range(n)]  # 5 req/s
    profile = TPProfile((14.7, 0.0686, 2.4e-6), (13.3, 3.4e-4, 0.063), (10.6, 3.1e-4, 0.086))
    spec = InstanceSpec(StepModel(profile), 1, 163008)
    started = time.perf_counter()
    Simulator(prompts, outputs, arrivals, prefill=[spec], decode=[spec]).run()
    # Well under a second on one core when the machine is quiet; the bound allows for sharing.
    assert time.perf_counter() - started < 5.0
