"""`pdserve profile` on a tiny model: the real engine measured, the real KV channel timed, the
file written in DistServe's shape, and the planner loads it and simulates with it."""

from __future__ import annotations

import json

import pytest

from benchmarks.goodput import layouts
from benchmarks.profiling.path import PathRow, _cpu_s, count_steps, fit_handoff, fit_path
from deploy.cli.main import main as pdserve
from planner.metrics import RequestRecord
from planner.placement import Parallel, Placement, simulate
from planner.profile import load_profile
from planner.workload import synthetic_workload


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(layouts.ensure_bench_model(tmp_path_factory.mktemp("model"), "tiny"))


def test_quick_profile_loads_and_drives_the_simulator(tiny_model: str, tmp_path) -> None:
    out, raw = tmp_path / "profile.json", tmp_path / "raw.json"
    code = pdserve(
        [
            "profile",
            "--bench-model",
            tiny_model,
            "--quick",
            "--out",
            str(out),
            "--raw-out",
            str(raw),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    (entry,) = data[tiny_model].values()
    assert set(entry) >= {
        "prefill",
        "decoding_smallbs",
        "decoding_largebs",
        "decoding_large_small_bs_threshold",
        "transfer",
        "kv_bytes_per_token",
    }
    profile = load_profile(out)
    tp1 = profile.tp(1)
    # The tiny model: 2 layers x 2 KV heads x head_dim 16, K and V, float32.
    assert tp1.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert tp1.transfer_GBps and tp1.transfer_GBps > 0
    samples = json.loads(raw.read_text())["1"]
    # Mixed steps: a chunk beside each running batch, the chunk and its attention term exact.
    assert tp1.chunked_prefill is not None
    assert {b for b, *_ in samples["mixed"]} == {4, 16}
    assert all(0 < m <= 512 and attn >= m * m for _, _, m, attn, _ in samples["mixed"])
    # Every prefill point fits the step budget and the model; decode has every batch size.
    assert all(sum(lens) <= 2048 and max(lens) < 512 for lens, _ in samples["prefill"])
    assert sorted({b for b, _, _ in samples["decode"]}) == [1, 2, 3, 8, 32]
    # each batch size to BY_BATCH_MAX has its own step constant; 32 is the triple's
    assert sorted(tp1.decode_by_batch) == [1, 2, 3, 8]
    assert all(ms > 0 for ms in tp1.decode_by_batch.values())
    a, b, _ = tp1.prefill
    assert a + b * 128 > 0  # a 128-token prompt takes time
    placement = Placement("disaggregated", Parallel(1, 1, 1), Parallel(1, 1, 1))
    workload = synthetic_workload("chatbot", 20, 512, seed=0)
    result = simulate(placement, profile, workload, 1.0)
    assert (result.ttft_ms > 0).all() and (result.tpot_ms >= 0).all()


def test_fit_path_recovers_planted_costs() -> None:
    # B requests of O outputs in S emitting steps: worker extra = O*2 + B*O*0.5 (sent at
    # once); relay = B*3 + S*1.5 + B*O*0.25 (spaced sends: S = B*O, one token a step).
    shapes = [(1, 20, 0.0), (4, 20, 0.0), (9, 10, 0.0), (4, 10, 1.0), (8, 4, 1.0)]
    rows = [
        PathRow(
            b,
            o,
            b * o if gap else o + 1,
            None if gap else o * 2.0 + b * o * 0.5,
            b * 3.0 + (b * o if gap else o + 1) * 1.5 + b * o * 0.25,
        )
        for b, o, gap in shapes
    ]
    terms = fit_path(rows, [50.0, 52.0, 51.0], prefill_ms=40.0)
    assert terms["worker_step_ms"] == pytest.approx(2.0)
    assert terms["worker_seq_ms"] == pytest.approx(0.5)
    assert terms["relay_request_ms"] == pytest.approx(3.0)
    assert terms["relay_step_ms"] == pytest.approx(1.5)
    assert terms["relay_token_ms"] == pytest.approx(0.25)
    assert terms["path_ttft_ms"] == pytest.approx(11.0)


def test_count_steps_groups_one_step_tokens() -> None:
    one = RequestRecord("a", 4, 3, 0.0, [1.0, 1.020, 1.040])
    two = RequestRecord("b", 4, 3, 0.0, [1.0005, 1.0205, 1.100])
    assert count_steps([one, two]) == 4  # 1.0, 1.02, 1.04, 1.1


@pytest.mark.slow  # a worker process behind a real router
def test_profile_path_measures_the_serving_path_behind_a_real_router(
    tiny_model: str, tmp_path
) -> None:
    """`--path` starts one colocated instance behind the router and times the hops."""
    out = tmp_path / "profile.json"
    code = pdserve(
        [
            "profile",
            "--bench-model",
            tiny_model,
            "--quick",
            "--path",
            "--no-transfer",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    path = load_profile(out).tp(1).serving_path
    assert path["path_ttft_ms"] > 0 and path["relay_token_ms"] + path["relay_step_ms"] > 0
    assert path["relay_idle_ms_per_s"] >= 0
    assert path["worker_step_ms"] >= 0 and path["worker_seq_ms"] >= 0
    # the KV hand-off, on a real 1 prefill + 1 decode cluster
    assert path["handoff_ms"] >= 0
    assert all(
        path[k] >= 0
        for k in ("kv_send_ms", "kv_send_ms_per_token", "kv_receive_ms", "kv_receive_ms_per_token")
    )


def test_fit_handoff_recovers_known_costs() -> None:
    rows = [(n, 4.0 + 0.02 * n, 1.5 + 0.01 * n) for n in (64, 256, 512)]
    fitted = fit_handoff(rows)
    assert fitted["kv_send_ms"] == pytest.approx(4.0)
    assert fitted["kv_send_ms_per_token"] == pytest.approx(0.02)
    assert fitted["kv_receive_ms"] == pytest.approx(1.5)
    assert fitted["kv_receive_ms_per_token"] == pytest.approx(0.01)
    # a cost below the engine model's (a faster engine than profiled) is no cost
    assert fit_handoff([(64, -3.0, 0.0), (512, -5.0, 0.0)])["kv_send_ms"] == 0.0


def test_process_cpu_is_read_finer_than_the_tick() -> None:
    # A request's cost on a worker is a few ms; the kernel's tick counters move by 10 ms.
    import os
    import time

    before, began = _cpu_s([os.getpid()]), time.thread_time()
    while time.thread_time() - began < 0.013:
        pass
    spent = _cpu_s([os.getpid()]) - before
    assert 0.012 <= spent < 0.05
    assert abs(spent * 1e3 - 10 * round(spent * 100)) > 1e-6  # not a whole number of ticks


def test_transfer_sizes_scale_up_until_the_bytes_can_be_timed() -> None:
    from benchmarks.profiling.transfer import MIN_LARGEST_TRANSFER_BYTES, transfer_token_sizes

    tiny = transfer_token_sizes((64, 512, 2048), 512)  # a test model: 512 bytes a token
    assert tiny == [64 * 8, 512 * 8, 2048 * 8] and tiny[-1] * 512 >= MIN_LARGEST_TRANSFER_BYTES
    assert transfer_token_sizes((64, 512, 2048), 92_160) == [64, 512, 2048]  # big enough already
