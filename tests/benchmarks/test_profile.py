"""`pdserve profile` on a tiny model: the real engine measured, the real KV channel timed, the
file written in DistServe's shape, and the planner loads it and simulates with it."""

from __future__ import annotations

import json

import pytest

from benchmarks.goodput import layouts
from benchmarks.profiling.path import fit_path
from deploy.cli.main import main as pdserve
from planner.placement import Parallel, Placement, simulate
from planner.profile import load_profile
from planner.workload import synthetic_workload


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(layouts.ensure_bench_model(tmp_path_factory.mktemp("model"), "tiny"))


def test_quick_profile_loads_and_drives_the_simulator(tiny_model: str, tmp_path) -> None:
    out, raw = tmp_path / "profile.json", tmp_path / "raw.json"
    code = pdserve(["profile", "--bench-model", tiny_model, "--quick", "--out", str(out),
                    "--raw-out", str(raw)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    (entry,) = data[tiny_model].values()
    assert set(entry) >= {"prefill", "decoding_smallbs", "decoding_largebs",
                          "decoding_large_small_bs_threshold", "transfer", "kv_bytes_per_token"}  # fmt: skip
    profile = load_profile(out)
    tp1 = profile.tp(1)
    # The tiny model: 2 layers x 2 KV heads x head_dim 16, K and V, float32.
    assert tp1.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert tp1.transfer_GBps and tp1.transfer_GBps > 0
    samples = json.loads(raw.read_text())["1"]
    # Every prefill point fits the step budget and the model; decode has every batch size.
    assert all(sum(lens) <= 2048 and max(lens) < 512 for lens, _ in samples["prefill"])
    assert sorted({b for b, _, _ in samples["decode"]}) == [1, 8, 32]
    a, b, _ = tp1.prefill
    assert a + b * 128 > 0  # a 128-token prompt takes time
    placement = Placement("disaggregated", Parallel(1, 1, 1), Parallel(1, 1, 1))
    workload = synthetic_workload("chatbot", 20, 512, seed=0)
    result = simulate(placement, profile, workload, 1.0)
    assert (result.ttft_ms > 0).all() and (result.tpot_ms >= 0).all()


def test_fit_path_recovers_planted_costs() -> None:
    # B requests of O outputs: worker extra = O*2 + B*O*0.5; relay = B*3 + B*O*0.25.
    shapes = [(1, 20), (4, 20), (9, 10)]
    rows = [(b, o, o * 2.0 + b * o * 0.5, b * 3.0 + b * o * 0.25) for b, o in shapes]
    terms = fit_path(rows, [50.0, 52.0, 51.0], prefill_ms=40.0)
    assert terms["worker_step_ms"] == pytest.approx(2.0)
    assert terms["worker_seq_ms"] == pytest.approx(0.5)
    assert terms["relay_request_ms"] == pytest.approx(3.0)
    assert terms["relay_token_ms"] == pytest.approx(0.25)
    assert terms["path_ttft_ms"] == pytest.approx(11.0)


def test_profile_path_measures_the_serving_path_behind_a_real_router(
    tiny_model: str, tmp_path
) -> None:
    """`--path` starts one colocated instance behind the router and times the hops."""
    out = tmp_path / "profile.json"
    code = pdserve(["profile", "--bench-model", tiny_model, "--quick", "--path", "--no-transfer",
                    "--out", str(out)])  # fmt: skip
    assert code == 0
    path = load_profile(out).tp(1).serving_path
    assert path["path_ttft_ms"] > 0 and path["relay_token_ms"] > 0
    assert path["worker_step_ms"] >= 0 and path["worker_seq_ms"] >= 0
