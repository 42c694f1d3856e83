"""Predict this machine: `pdserve profile`'s coefficients through the simulator, against the
goodputs that `pdserve bench --compare` measured, per regime and layout.

A measured run (a `pdserve bench --compare` output folder with its raw/) gives, per regime, its
exact requests (prompt and output lengths, unit-rate gaps), its SLOs, its engine settings and
its measured goodput for both layouts. The simulator replays the same requests through both
layouts as the benchmark runs them on this machine, at the rates the benchmark's sweep picks:
  disaggregated  1 prefill + 1 decode instance, TP=1 each, the KV over the measured channel
  colocated      2 replicas, chunked prefill (chunk 512, 2048-token budget, 64 sequences)
and goodput comes from planner/metrics.goodput on those (rate, attainment) points, as the
benchmark's own does.

Terms the engine profile alone lacks, each measured by `pdserve profile --path` on a real
instance behind the real router (benchmarks/profiling/path.py), none fitted to a goodput:
  path_ttft_ms                  the hops to a first token (client -> router -> worker -> back)
  worker_step_ms, worker_seq_ms the worker's CPU per step and per sequence beyond the engine:
                                its loop, and the gRPC stream that carries each token out
  relay_*_ms                     the router's and the client's CPU per token, request, emitting
                                step and idle second; they are not pinned, so the part of it
                                that finds no core idle comes off the workers' cores
                                (planner/serving_path.py)
  kv_send_ms, kv_receive_ms     what a request's KV costs the prefill's and the decode's cores
A profile without them falls back on the run's own unloaded calibration (raw/*.json). The
engine's decode step is measured at every batch size to 16 (decoding_by_batch): CPU GEMM makes it
a sawtooth there, which a line through batches 1, 4, 8, 16 misses by up to 4 ms.
And two mechanisms of pdserve's dispatch (planner/simulator.py): a disaggregated request waits
for the decode loop's step under way before its prompt is queued (`reserve_before_prefill`); a
colocated prompt goes to the replica with the fewest prompt tokens short of a first token
(least_tokens).
`compare_profiles` takes several profiles (speed drifts) and reports the median and range.
"""

from __future__ import annotations

import gzip
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.goodput.report import slos_of
from benchmarks.goodput.sweep import SweepPolicy, sweep_rates
from planner import metrics
from planner.latency import StepModel
from planner.placement import Parallel, Placement, simulate
from planner.profile import ModelProfile
from planner.search import SLO, Cluster, SearchSettings, plan
from planner.serving_path import (
    apply_serving_path,
    measured_link,
    relay_of,
    simulate_relayed,
    ttft_path_ms,
)
from planner.sim_spec import LinkSpec, SimOptions, SimResult
from planner.workload import Workload

LAYOUTS = {
    "disaggregated": Placement("disaggregated", Parallel(1, 1, 1), Parallel(1, 1, 1)),
    "colocated": Placement("colocated", colocated=Parallel(1, 1, 2)),
}
NUM_DEVICES = 2


@dataclass(frozen=True)
class Regime:
    name: str
    workload: Workload
    ttft_slo_ms: float
    tpot_slo_ms: float
    calibration: dict[str, float]
    measured: dict[str, float]  # layout -> goodput per device
    config: dict[str, Any]
    # layout -> its 90% bootstrap interval over the run's requests (metrics.goodput_interval)
    interval: dict[str, tuple[float, float]]
    sweep: SweepPolicy  # the run's rate sweep


def measured_interval(raw: dict[str, Any], layout: str) -> tuple[float, float]:
    """How far the layout's measured goodput moves on the luck of its requests alone."""
    slos = slos_of(raw["slo"])
    points = []
    for point in raw["layouts"][layout]["points"]:
        records = [metrics.RequestRecord.from_json(r) for r in point["records"]]
        met = [metrics.meets_slo(r, slos) for r in records]
        points.append((point["rate_per_device"], met))
    return metrics.goodput_interval(points)


def _open(path: Path) -> Any:
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path, encoding="utf-8")


def load_measured(directory: str | Path) -> list[Regime]:
    """Every regime of one shape in a `pdserve bench --compare` output folder (summary.json +
    raw/). A mix of shapes (mixed, shift: SLOs per request class) is left out: the simulator's
    workloads carry one pair of SLOs."""
    directory = Path(directory)
    summary = json.loads((directory / "summary.json").read_text())
    regimes = []
    for name, entry in summary["regimes"].items():
        raw_path = next((directory / "raw").glob(f"{name}.json*"))
        with _open(raw_path) as handle:
            raw = json.load(handle)
        if "classes" in raw["slo"]:
            continue
        requests = raw["requests"]
        offsets, now = [], 0.0
        for index, request in enumerate(requests):
            if index:  # the benchmark's arrival_offsets: the first request at 0
                now += request["unit_gap_s"]
            offsets.append(now)
        workload = Workload(
            name,
            tuple(r["prompt_len"] for r in requests),
            tuple(r["output_len"] for r in requests),
            tuple(offsets),
        )
        regimes.append(
            Regime(
                name,
                workload,
                1e3 * raw["slo"]["ttft_s"],
                1e3 * raw["slo"]["tpot_s"],
                raw["slo"]["calibration"],
                {
                    "disaggregated": entry["goodput_disaggregated"],
                    "colocated": entry["goodput_colocated"],
                },
                raw["config"],
                {layout: measured_interval(raw, layout) for layout in LAYOUTS},
                SweepPolicy.of_run(raw["config"], raw["slo"]["start_rate"]),
            )
        )
    return regimes


def with_terms(profile: ModelProfile, regimes: list[Regime]) -> ModelProfile:
    """The profile with its serving-path terms: measured by `pdserve profile --path` when it
    has them, else the run's unloaded calibrations less the engine's own times (TTFT, step)."""
    if profile.tp(1).serving_path:
        return profile
    model = StepModel(profile.tp(1))
    ttft, step = [], []
    for regime in regimes:
        length = regime.calibration["prompt_len"]
        engine_prefill = model.prefill_stage_ms(length, length * length) - 1  # no pp constant
        ttft.append(1e3 * regime.calibration["prefill_s"] - engine_prefill)
        step.append(1e3 * regime.calibration["decode_step_s"] - model.decode_stage_ms(1, length))
    path = {"path_ttft_ms": statistics.median(ttft), "worker_step_wall_ms": statistics.median(step)}
    return profile.with_updates(serving_path=path)


def sim_options(profile: ModelProfile, regime: Regime) -> tuple[SimOptions, LinkSpec | None]:
    """The benchmark's engine settings, the TTFT path term and the measured KV channel."""
    config, tp1 = regime.config, profile.tp(1)
    budget = config.get("max_num_batched_tokens", 2048)
    options = SimOptions(
        colocated_policy="chunked",
        chunk_size=config.get("chunk_size", 512),
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        prefill_max_tokens=budget,
        ttft_path_ms=ttft_path_ms(profile),
        reserve_before_prefill=True,
    )
    return options, measured_link(tp1)


def predict(profile: ModelProfile, regime: Regime) -> dict[str, float]:
    """Predicted goodput per device of each layout, as `pdserve bench` measures it: the
    simulator runs the points the benchmark's sweep runs (the same rule picks each next rate from
    the attainments so far, each point sends the same first requests), and the goodput
    interpolates between those points, as the benchmark's does."""
    options, link = sim_options(profile, regime)
    relay = relay_of(profile)
    profile = apply_serving_path(profile)

    def swept(placement: Placement) -> float:
        points: list[tuple[float, float]] = []

        def attainment_at(total: float) -> float:
            workload = regime.workload.head(regime.sweep.num_requests(total, len(regime.workload)))

            def run(opts: SimOptions) -> SimResult:
                return simulate(placement, profile, workload, total, link=link, options=opts)

            mean_output = statistics.mean(workload.output_lens)
            result = simulate_relayed(run, options, relay, total, mean_output, NUM_DEVICES)
            met = (result.ttft_ms <= regime.ttft_slo_ms) & (result.tpot_ms <= regime.tpot_slo_ms)
            points.append((total / NUM_DEVICES, float(met.mean())))
            return points[-1][1]

        sweep_rates(regime.sweep, attainment_at)
        return metrics.goodput(points).rate

    return {layout: swept(placement) for layout, placement in LAYOUTS.items()}


def plan_regime(profile: ModelProfile, regime: Regime) -> dict[str, Any]:
    """What `pdserve plan` picks on this machine (1 node x 2 cores) for the regime."""
    options, link = sim_options(profile, regime)
    settings = SearchSettings(
        max_per_gpu_rate=20.0,
        link=link,
        options=options,
        pp_choices=(1,),
        relay=relay_of(profile),
        colocated_fill=True,
    )
    slo = SLO(regime.ttft_slo_ms, regime.tpot_slo_ms, 0.9)
    result = plan(
        apply_serving_path(profile),
        regime.workload,
        slo,
        Cluster(1, NUM_DEVICES),
        settings,
        algorithms=("low",),
    )
    return {
        "best": result.best.placement.describe(),
        "layout": result.best.placement.layout,
        "ratio": round(result.winner_ratio, 3),
    }


def compare(profile: ModelProfile, directory: str | Path) -> dict[str, Any]:
    """Predicted vs measured for every regime and layout, the plan per regime, the worst
    relative error; `engine_only` is the same without the serving-path terms."""
    regimes = load_measured(directory)
    full = with_terms(profile, regimes)
    bare = profile.with_updates(serving_path={})
    rows: list[dict[str, Any]] = []
    plans = {}
    for regime in regimes:
        predicted = predict(full, regime)
        engine_only = predict(bare, regime)
        for layout, measured in regime.measured.items():
            rows.append(
                {
                    "regime": regime.name,
                    "layout": layout,
                    "measured": round(measured, 3),
                    "measured_interval90": [round(v, 3) for v in regime.interval[layout]],
                    "predicted": round(predicted[layout], 3),
                    "predicted_engine_only": round(engine_only[layout], 3),
                    "error": round(predicted[layout] / measured - 1, 3) if measured else None,
                }
            )
        chosen = plan_regime(full, regime)
        best_measured = max(regime.measured, key=lambda k: regime.measured[k])
        plans[regime.name] = {
            **chosen,
            "measured_best": best_measured,
            "agrees": chosen["layout"] == best_measured,
        }
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {
        "serving_path": {k: round(v, 3) for k, v in full.tp(1).serving_path.items()},
        "rows": rows,
        "plans": plans,
        "cpu_prediction_error": round(max(errors), 3) if errors else None,
    }


def compare_profiles(profiles: list[ModelProfile], directory: str | Path) -> dict[str, Any]:
    """`compare` for each of several profiles of this machine (`pdserve profile` run again: one
    run is a few minutes of a machine whose speed drifts by ~10%): each row's median prediction
    and its range over the profiles, the error of the median, and how many plans agree."""
    runs = [compare(profile, directory) for profile in profiles]
    rows = []
    for index, row in enumerate(runs[0]["rows"]):
        predicted = [run["rows"][index]["predicted"] for run in runs]
        median = statistics.median(predicted)
        engine_only = statistics.median(run["rows"][index]["predicted_engine_only"] for run in runs)
        measured = row["measured"]
        rows.append(
            {
                **row,
                "predicted": round(median, 3),
                "predicted_range": [min(predicted), max(predicted)],
                "predicted_engine_only": round(engine_only, 3),
                "error": round(median / measured - 1, 3) if measured else None,
            }
        )
    plans = {}
    for name, entry in runs[0]["plans"].items():
        agreeing = sum(run["plans"][name]["agrees"] for run in runs)
        plans[name] = {
            **entry,
            "layouts": [run["plans"][name]["layout"] for run in runs],
            "agrees": 2 * agreeing > len(runs),
            "agree_count": agreeing,
        }
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {
        "num_profiles": len(runs),
        "serving_path": [run["serving_path"] for run in runs],
        "rows": rows,
        "plans": plans,
        "cpu_prediction_error": round(max(errors), 3) if errors else None,
        "cpu_prediction_error_per_profile": [r["cpu_prediction_error"] for r in runs],
    }


def write_table_and_plot(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """prediction.md (predicted vs measured, per regime and layout) and prediction.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    count = result.get("num_profiles", 1)
    lines = [
        f"| regime | layout | measured (req/s/core) | its 90% interval | predicted (median of "
        f"{count}) | range | error | engine only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        low, high = row.get("predicted_range", [row["predicted"]] * 2)
        m_low, m_high = row["measured_interval90"]
        lines.append(
            f"| {row['regime']} | {row['layout']} | {row['measured']:.2f} | "
            f"{m_low:.2f}-{m_high:.2f} | {row['predicted']:.2f} | {low:.2f}-{high:.2f} | "
            f"{100 * row['error']:+.0f}% | {row['predicted_engine_only']:.2f} |"
        )
    lines += [
        "",
        "| regime | `pdserve plan` picks | measured best | agrees |",
        "| --- | --- | --- | --- |",
    ]
    for name, entry in result["plans"].items():
        agree = entry.get("agree_count", int(entry["agrees"]))
        lines.append(
            f"| {name} | {entry['best']} | {entry['measured_best']} | {agree} of {count} profiles |"
        )
    table = out_dir / "prediction.md"
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    figure, axis = plt.subplots(figsize=(7, 4))
    short = {"disaggregated": "1P+1D", "colocated": "2 colocated"}
    labels = [f"{r['regime']}\n{short.get(r['layout'], r['layout'])}" for r in result["rows"]]
    xs = range(len(labels))
    measured = [r["measured"] for r in result["rows"]]
    intervals = [r["measured_interval90"] for r in result["rows"]]
    noise = [
        [m - lo for m, (lo, _) in zip(measured, intervals, strict=True)],
        [hi - m for m, (_, hi) in zip(measured, intervals, strict=True)],
    ]
    axis.bar(
        [x - 0.2 for x in xs],
        measured,
        0.4,
        yerr=noise,
        capsize=3,
        label="measured (pdserve bench --compare: 90% bootstrap interval)",
    )
    predicted = [r["predicted"] for r in result["rows"]]
    ranges = [r.get("predicted_range", [r["predicted"]] * 2) for r in result["rows"]]
    spread = [
        [p - lo for p, (lo, _) in zip(predicted, ranges, strict=True)],
        [hi - p for p, (_, hi) in zip(predicted, ranges, strict=True)],
    ]
    axis.bar(
        [x + 0.2 for x in xs],
        predicted,
        0.4,
        yerr=spread,
        capsize=3,
        label=f"predicted (pdserve profile x{count} + simulator: median, range)",
    )
    axis.set_xticks(list(xs), labels, fontsize=8)
    axis.set_ylabel("goodput, requests/s per core")
    axis.set_title(f"This machine: worst error {100 * result['cpu_prediction_error']:.0f}%")
    axis.legend(fontsize=8)
    figure.tight_layout()
    plot = out_dir / "prediction.png"
    figure.savefig(plot, dpi=120)
    plt.close(figure)
    return table, plot
