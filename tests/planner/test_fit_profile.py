"""The least-squares fit recovers known coefficients; profiles round-trip in DistServe's shape."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from planner.fit import fit_decode, fit_decode_by_batch, fit_mixed, fit_prefill, fit_transfer
from planner.latency import StepModel
from planner.profile import (
    TPProfile,
    load_profile,
    load_profiles,
    save_profiles,
    with_max_num_tokens,
)

SHARED = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "distserve"


def test_fit_recovers_prefill_decode_and_transfer_coefficients() -> None:
    rng = random.Random(0)
    prefill = (14.7, 0.0686, 2.45e-6)
    samples = []
    for _ in range(40):
        lens = [rng.randint(16, 2000) for _ in range(rng.randint(1, 6))]
        exact = prefill[0] + prefill[1] * sum(lens) + prefill[2] * sum(x * x for x in lens)
        samples.append((lens, exact * (1 + rng.uniform(-0.002, 0.002))))
    a, b, c = fit_prefill(samples)
    assert a == pytest.approx(prefill[0], rel=0.05)
    assert b == pytest.approx(prefill[1], rel=0.02)
    assert c == pytest.approx(prefill[2], rel=0.1)

    small, large = (19.9, 6.3e-4, 0.0385), (7.17, 5.8e-4, 0.158)
    decode = []
    for batch in [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]:
        for ctx in (100, 500, 1500):
            a_, b_, c_ = small if batch < 95 else large
            decode.append((batch, batch * ctx, a_ + b_ * batch * (ctx + 1) + c_ * batch))
    got_small, got_large = fit_decode(decode, threshold=95)
    assert got_small == pytest.approx(small, rel=1e-6)
    assert got_large == pytest.approx(large, rel=1e-6)

    sizes = [1 << k for k in range(16, 28)]
    gbps, per_message = fit_transfer([(n, 0.3 + n / (12.5 * 1e6)) for n in sizes])
    assert gbps == pytest.approx(12.5, rel=1e-6)
    assert per_message == pytest.approx(0.3, rel=1e-6)


def test_fit_leaves_out_a_disturbed_window() -> None:
    # A profile's decode points, two of them measured while something else held the core
    # (35% and 60% slow): plain least squares moves the intercept by ~2 ms; the fit must not.
    triple = (10.5, 0.0024, 0.55)
    decode = []
    for ctx in (32, 128, 384, 768):
        for batch in (1, 4, 8, 16, 32, 64):
            exact = triple[0] + triple[1] * batch * (ctx + 1) + triple[2] * batch
            decode.append((batch, batch * ctx, exact))
    decode[0] = (decode[0][0], decode[0][1], decode[0][2] * 1.6)
    decode[1] = (decode[1][0], decode[1][1], decode[1][2] * 1.35)
    small, _ = fit_decode(decode)
    assert small == pytest.approx(triple, rel=1e-6)


def test_fit_by_batch_recovers_a_sawtooth_the_triple_cannot() -> None:
    # CPU GEMM takes rows in blocks of four: a step at B costs 11 + 4*(B % 4) + B/2 ms plus
    # the context. The triple misses batch 3 by more than 2 ms; the per-batch fit is exact.
    per_token = 0.002
    constant = {b: 11.0 + 4.0 * (b % 4) + 0.5 * b for b in range(1, 17)}
    decode = []
    for ctx in (32, 128, 384, 768):
        for batch in (*range(1, 17), 24, 32, 64):
            steady = constant.get(batch, 11.0 + 0.5 * batch + 6.0)
            decode.append((batch, batch * ctx, steady + per_token * batch * (ctx + 1)))
    small, _ = fit_decode(decode)
    table = fit_decode_by_batch(decode, small, 16)
    assert sorted(table) == list(range(1, 17))
    context_term = small[1] * 3 * (300 + 1)
    for batch, exact in constant.items():
        assert table[batch] + context_term == pytest.approx(exact + per_token * 3 * 301, abs=0.3)
    profile = TPProfile(
        prefill=(1.0, 0.1, 0.0), decode_small=small, decode_large=small, decode_by_batch=table
    )
    model = StepModel(profile)
    assert model.decode_stage_ms(3, 900) > model.decode_stage_ms(4, 1200)  # the sawtooth
    assert model.decode_stage_ms(3, 900) == pytest.approx(table[3] + small[1] * 903)
    bare = StepModel(TPProfile(prefill=(1.0, 0.1, 0.0), decode_small=small, decode_large=small))
    assert abs(bare.decode_stage_ms(3, 900) - (constant[3] + per_token * 903)) > 2.0
    assert model.decode_stage_ms(24, 2400) == bare.decode_stage_ms(24, 2400)  # past the table


def test_fit_mixed_recovers_a_chunk_beside_decodes() -> None:
    # A mixed step = a' + b'*m + c'*(m² + 2mp) + the decodes' b*Σ(ctx+1) + c*B (no intercept).
    decode = (10.0, 0.002, 0.5)
    mixed, samples = (20.0, 0.6, 2e-4), []
    for batch, sum_ctx in ((4, 600), (16, 3000)):
        for m, p in ((64, 0), (256, 0), (512, 0), (256, 512)):
            attn = m * m + 2 * m * p
            rest = mixed[0] + mixed[1] * m + mixed[2] * attn
            samples.append(
                (batch, sum_ctx, m, attn, rest + 0.002 * (sum_ctx + batch) + 0.5 * batch)
            )
    assert fit_mixed(samples, decode) == pytest.approx(mixed, rel=1e-6)
    with pytest.raises(ValueError, match=">= 3 samples"):
        fit_mixed(samples[:2], decode)


def test_fit_refuses_too_few_samples() -> None:
    with pytest.raises(ValueError, match=">= 3 samples"):
        fit_prefill([([10], 1.0), ([20], 2.0)])


def test_distserve_profile_loads_and_our_extras_round_trip(tmp_path: Path) -> None:
    profile = load_profile(SHARED / "profiler-a100-80g.distserve.json", "facebook/opt-13b")
    assert sorted(profile.by_tp) == [1, 2, 4]
    assert profile.tp(2).prefill[0] == pytest.approx(14.742973695171262)
    assert profile.tp(1).threshold == 95
    profile = with_max_num_tokens(profile, SHARED / "max_num_tokens.csv")
    assert profile.max_tokens(1, 1) == 66144 and profile.max_tokens(2, 1) == 163008
    assert profile.tp(1).kv_bytes_per_token == 2 * 40 * 5120 * 2

    out = tmp_path / "ours.json"
    extra = profile.with_updates(
        transfer_GBps=3.1,
        transfer_per_message_ms=0.2,
        chunked_intercept=12.0,
        chunked_prefill=(9.0, 0.5, 1e-4),
        decode_by_batch={1: 11.0, 3: 19.5},
    )
    save_profiles(out, {extra.model: extra})
    raw = json.loads(out.read_text())
    assert raw["facebook/opt-13b"]["2"]["prefill"] == list(profile.tp(2).prefill)
    assert raw["facebook/opt-13b"]["2"]["transfer"]["bandwidth_GBps"] == 3.1
    assert raw["facebook/opt-13b"]["2"]["decoding_by_batch"] == {"1": 11.0, "3": 19.5}
    again = load_profiles(out)["facebook/opt-13b"]
    assert again == extra


def test_a_bad_triple_names_the_key() -> None:
    with pytest.raises(ValueError, match="prefill must be a list of three numbers"):
        TPProfile.from_json(
            "x", {"prefill": [1, 2], "decoding_smallbs": [1, 2, 3], "decoding_largebs": [1, 2, 3]}
        )
