"""The comparison in one command: one workload, the layouts (layouts.py: disaggregated, the
colocated baseline, adaptive; --layouts picks) on the same devices, a rate sweep each, goodput at
every SLO scale, plots.

    python -m benchmarks.goodput --compare [--out DIR] [--quick]   (= pdserve bench ...)

For each regime (a synthetic shape, or a ShareGPT file): make the requests, start every layout's
local cluster (or use a running router, --target) and warm each up, then sweep the rate
(sweep.py) of all of them side by side, one point of each layout in turn, and shut them down.
Every request carries its class's SLOs, which the adaptive layout places it by. The SLOs (unless given) are the shape's factors times
the unloaded TTFT and TPOT measured through the first layout's router once it is warm
(calibrate.py), so they include what the serving path costs (gRPC, router, worker process);
`--calibrate engine` measures one engine alone in this process instead. Output in --out:
    raw/{regime}.json   config, workload, SLOs, every request's timings at every rate
    summary.json        goodputs, ratio and SLOs of the main regime; per regime the ratio and
                        adaptive_over_best (adaptive over the better fixed layout)
    {regime}_*.png      plots.py
The last line printed is summary.json's content as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.goodput import layouts
from benchmarks.goodput.calibrate import calibrate, calibrate_via_router
from benchmarks.goodput.driver import LoadDriver
from benchmarks.goodput.humaneval import humaneval_prompts
from benchmarks.goodput.options import QUICK_REGIME, parse_bench_args, parse_target
from benchmarks.goodput.plots import plot_regime
from benchmarks.goodput.report import regime_summary, slos_of
from benchmarks.goodput.sharegpt import read_sharegpt, resolve_sharegpt_path, sharegpt_prompts
from benchmarks.goodput.sweep import RatePoint, RateSweep, SweepPolicy, sweep_steps, warm_up
from benchmarks.goodput.workloads import REAL_REGIMES, REAL_SOURCES, random_prompts
from planner.traffic import MIXES, SHAPES, synthetic_lengths, unit_rate_gaps

SUMMARY_SCHEMA = "pdserve.goodput.summary/2"
RAW_SCHEMA = "pdserve.goodput.raw/1"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "goodput-llama"


def _regime_prompts(
    args: argparse.Namespace, model_dir: Path, name: str, num: int, source: dict[str, Any]
) -> list:
    """The regime's (prompt ids, output length) pairs; what a real file held goes in `source`."""
    max_model_len, _ = layouts.model_limits(model_dir)
    if name == "sharegpt":
        data = read_sharegpt(resolve_sharegpt_path(args.sharegpt))
        source.update(data.to_json())
        if data.num_dropped:
            print(
                f"[bench] {data.path}: {data.num_entries} complete conversations kept, "
                f"{data.num_dropped} cut off at the end dropped ({data.dropped_bytes} bytes)",
                file=sys.stderr,
            )
        encode = layouts.make_encoder(model_dir)
        return sharegpt_prompts(data.pairs, encode, num, max_model_len, args.seed)
    if name == "humaneval":
        return humaneval_prompts(layouts.make_encoder(model_dir), num, max_model_len, args.seed)
    if name in MIXES:  # request i takes the i-th draw of its own shape
        draws = {
            shape: synthetic_lengths(SHAPES[shape], num, max_model_len, args.seed + index)
            for index, shape in enumerate(MIXES[name].shapes)
        }
        lengths = [draws[shape][i] for i, shape in enumerate(regime_classes(args, name, num))]
    else:
        lengths = synthetic_lengths(SHAPES[name], num, max_model_len, args.seed)
    return random_prompts(lengths, layouts.prompt_token_range(model_dir), args.seed)


def regime_classes(args: argparse.Namespace, name: str, num: int) -> list[str]:
    """Each request's SLO class: its shape in a mix, none ("") in a regime of one shape."""
    return MIXES[name].classes(num, args.seed) if name in MIXES else [""] * num


def _calibrates_through_baseline(args: argparse.Namespace) -> bool:
    """Locally, by default, the SLOs are multiples of what the colocated baseline's whole path
    (gRPC, router, worker process, engine) takes unloaded, measured once it has started."""
    return not args.target and args.calibrate == "path"


SLO_BASE_PERCENTILE = 90


def slo_base_prompt_len(prompt_lens: list[int]) -> int:
    """The prompt length whose unloaded latencies the SLO factors multiply: the workload's 90th
    percentile. On the median, every prompt longer than `factor` times its prefill missed the
    TTFT SLO at any rate (4-8 of 50 in code and chatbot), attainment sat near 90% from the lowest
    rate up and goodput turned on one request; on the 90th percentile an unloaded run attains
    about 100%, and the 90% crossing is set by load."""
    ordered = sorted(prompt_lens)
    return ordered[min(len(ordered) - 1, len(ordered) * SLO_BASE_PERCENTILE // 100)]


def _slo_and_start(
    args,
    model_dir: Path,
    name: str,
    prompts: list,
    classes: list[str],
    driver,
    address: str | None = None,
) -> dict[str, Any]:
    """The regime's SLOs (given, or shape factors x calibration) and the sweep's start rate;
    a mix's SLOs per class, each its shape's factors times a calibration on its own prompts.

    The calibration goes through a router: `address` (the local baseline, see
    `_calibrates_through_baseline`) or the first --target's; with `--calibrate engine` it runs
    one engine in this process instead, without the serving path around it."""
    if args.target:
        address = _targets(args)[0][1]
    if name not in MIXES:
        return _class_slo(args, model_dir, REAL_REGIMES.get(name, name), prompts, driver, address)
    per_class, work_s = {}, 0.0
    for shape in MIXES[name].shapes:
        mine = [prompt for prompt, c in zip(prompts, classes, strict=True) if c == shape]
        entry = _class_slo(args, model_dir, shape, mine, driver, address)
        work_s += len(mine) / len(prompts) * 0.6 / entry.pop("start_rate")
        through = entry.pop("calibrated_through")
        per_class[shape] = entry
    return {
        "classes": per_class,
        "calibrated_through": through,
        "start_rate": args.start_rate or 0.6 / work_s,
    }


def _class_slo(
    args, model_dir: Path, shape_name: str, prompts: list, driver, address: str | None
) -> dict[str, Any]:
    """One shape's SLOs from a calibration on its 90th-percentile prompt, and the start rate
    of a workload of it alone."""
    prompt_len = slo_base_prompt_len([len(ids) for ids, _ in prompts])
    output_len = statistics.median(out for _, out in prompts)
    token_range = layouts.prompt_token_range(model_dir)
    if address is not None:
        base = calibrate_via_router(driver, address, prompt_len, token_range)
    else:
        config = layouts.engine_config(
            model_dir,
            chunk_size=args.chunk_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        base = calibrate(config, prompt_len, token_range)
    shape = SHAPES[shape_name]  # ShareGPT is chatbot traffic, HumanEval code
    ttft_slo = args.ttft_slo or shape.ttft_slo_factor * base.prefill_s
    tpot_slo = args.tpot_slo or shape.tpot_slo_factor * base.decode_step_s
    # One core's work per request if decode batches of ~4 share each step; 0.6 of the rate it
    # sustains starts both layouts under their knees (the sweep climbs from there).
    work_s = base.prefill_s + output_len * base.decode_step_s / 4
    return {
        "ttft_s": ttft_slo,
        "tpot_s": tpot_slo,
        "calibration": base.to_json(),
        "calibrated_through": "engine" if address is None else "router",
        "ttft_factor": None if args.ttft_slo else shape.ttft_slo_factor,
        "tpot_factor": None if args.tpot_slo else shape.tpot_slo_factor,
        "start_rate": args.start_rate or 0.6 / work_s,
    }


def _targets(args: argparse.Namespace) -> list[tuple[str, str | None, int]]:
    """(layout, router address or None to start one here, devices) to run, in order."""
    if args.target:
        return [parse_target(text) for text in args.target]
    return [(layout, None, layouts.NUM_DEVICES[layout]) for layout in args.layouts]


def _start_layouts(
    args, model_dir, regime, prompts, classes, slo, driver, bar, clusters: list
) -> tuple[list[tuple[str, str, int]], dict[str, Any]]:
    """Start every layout that runs here (appending each to `clusters`, which the caller shuts
    down) and warm each up; `slo` None: then calibrate through the first one (the local
    baseline), with the others up and idle as they are between their points. Returns (layout,
    router address, devices) of each, and the SLOs."""
    started = []
    for layout, address, num_devices in _targets(args):
        if address is None:
            bar.set_description(f"{regime}: starting {layout}")
            spec = layouts.cluster_spec(
                layout,
                model_dir,
                pin_cpus=not args.no_pin,
                latency_profile=args.latency_profile,
                chunk_size=args.chunk_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            cluster = layouts.start_local_cluster(spec)
            clusters.append(cluster)
            address = cluster.address
        warm_up(driver, address, prompts)
        started.append((layout, address, num_devices))
    if slo is None:
        layout, address, _ = started[0]
        bar.set_description(f"{regime}: calibrating through {layout}")
        slo = _slo_and_start(args, model_dir, regime, prompts, classes, driver, address)
    return started, slo


def _sweep_interleaved(sweeps: dict[str, RateSweep], policy: SweepPolicy, regime: str, bar) -> None:
    """Every layout's sweep, one point of each in turn (each sweep picks its own next rate):
    a machine whose speed drifts over the regime then moves every layout alike, instead of
    whichever ran last (on this 2-core machine two runs of one layout moved 20-40% apart)."""
    steps = {layout: sweep_steps(policy) for layout in sweeps}
    pending = {layout: next(gen) for layout, gen in steps.items()}
    while pending:
        for layout in list(pending):
            bar.set_description(f"{regime}: {layout}")
            point = sweeps[layout].run_rate(pending[layout])
            try:
                pending[layout] = steps[layout].send(sweeps[layout].attainment(point))
            except StopIteration:
                del pending[layout]


def run_regime(args, model_dir: Path, regime: str, driver: LoadDriver, bar: Any) -> dict:
    """One regime end to end; writes raw/{regime}.json and its plots, returns its summary."""
    load_before = os.getloadavg()
    source: dict[str, Any] = {}
    prompts = _regime_prompts(args, model_dir, regime, args.num_requests, source)
    classes = regime_classes(args, regime, len(prompts))
    gaps = unit_rate_gaps(args.num_requests, args.arrival, args.cv, args.seed)
    slo = None
    if not _calibrates_through_baseline(args):
        slo = _slo_and_start(args, model_dir, regime, prompts, classes, driver)
    clusters: list[Any] = []
    try:
        started, slo = _start_layouts(
            args, model_dir, regime, prompts, classes, slo, driver, bar, clusters
        )

        def on_point(point: RatePoint, attained: float) -> None:
            bar.update(1)
            bar.set_postfix(rate=f"{point.rate_per_device:.2f}/dev", attained=f"{attained:.0%}")

        policy = SweepPolicy.of_run(vars(args), slo["start_rate"])
        mix = MIXES.get(regime)
        sweeps = {
            layout: RateSweep(
                driver,
                address,
                prompts,
                gaps,
                f"{regime}-{layout}",
                num_devices,
                slos_of(slo),
                policy,
                on_point,
                classes=classes,
                pick=mix.point_indices if mix else None,
            )
            for layout, address, num_devices in started
        }
        _sweep_interleaved(sweeps, policy, regime, bar)
    finally:
        for cluster in clusters:
            cluster.shutdown()
    assert slo is not None
    points_by_layout = {layout: sweeps[layout].points for layout, _, _ in started}
    devices = {layout: num_devices for layout, _, num_devices in started}
    addresses = {layout: address for layout, address, _ in started}
    summary = regime_summary(points_by_layout, slos_of(slo), args.slo_scales)
    workload = {
        "regime": regime,
        "source": _source(regime),
        "synthetic": regime in SHAPES or regime in MIXES,
        "data": source or None,
        "arrival": args.arrival,
        "cv": args.cv,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "mean_prompt_len": statistics.mean(len(ids) for ids, _ in prompts),
        "mean_output_len": statistics.mean(out for _, out in prompts),
    }
    summary.update(slo=slo, workload=workload, load_average_before=list(load_before))
    summary["devices"] = devices
    raw = {
        "schema": RAW_SCHEMA,
        "regime": regime,
        "config": _jsonable(vars(args)),
        "model_dir": str(model_dir),
        "slo": slo,
        "workload": workload,
        "requests": [
            {"prompt_len": len(ids), "output_len": out, "unit_gap_s": gap, "slo_class": slo_class}
            for (ids, out), gap, slo_class in zip(prompts, gaps, classes, strict=False)
        ],
        "layouts": {
            layout: {
                "num_devices": devices[layout],
                "address": addresses[layout],
                "points": [p.to_json() for p in points],
            }
            for layout, points in points_by_layout.items()
        },
    }
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    (args.out / "raw" / f"{regime}.json").write_text(json.dumps(raw))
    summary["plots"] = plot_regime(args.out, regime, points_by_layout, slos_of(slo), summary)
    return summary


def _source(regime: str) -> str:
    if regime in MIXES:
        return MIXES[regime].source
    return SHAPES[regime].source if regime in SHAPES else REAL_SOURCES[regime]


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """The options as JSON: paths as text; what is not data (the CLI's handler) left out."""
    plain = (str, int, float, bool, list, tuple, type(None))
    return {
        key: str(value) if isinstance(value, Path) else value
        for key, value in values.items()
        if isinstance(value, (Path, *plain))
    }


def _fill_defaults(args: argparse.Namespace) -> list[str]:
    """The regimes to run, and defaults that depend on --quick."""
    args.num_requests = args.num_requests or (30 if args.quick else 100)
    args.max_points = args.max_points or (4 if args.quick else 6)
    if args.sharegpt is not None:
        return ["sharegpt"]
    if args.workloads:
        return list(args.workloads)
    return [QUICK_REGIME] if args.quick else [QUICK_REGIME, "chatbot", "code"]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    started = time.time()
    regimes = _fill_defaults(args)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = layouts.ensure_bench_model(args.model_dir or DEFAULT_MODEL_DIR, args.model_size)
    num_layouts = len(_targets(args))
    points_each = len(args.rates) or args.max_points
    results: dict[str, Any] = {}
    with (
        LoadDriver(args.client_processes, args.ray_address) as driver,
        tqdm(
            total=len(regimes) * num_layouts * points_each, unit="rate", dynamic_ncols=True
        ) as bar,
    ):
        for regime in regimes:
            results[regime] = run_regime(args, model_dir, regime, driver, bar)
    main = results[regimes[0]]
    summary = {
        "schema": SUMMARY_SCHEMA,
        "main_regime": regimes[0],
        "goodput_disaggregated": main.get("goodput_disaggregated"),
        "goodput_colocated": main.get("goodput_colocated"),
        "goodput_ratio": main.get("goodput_ratio"),
        "goodputs": main["goodputs"],
        "goodput_unit": "requests/s per device",
        "slo": main["slo"],
        "workload": main["workload"],
        "ratios": {regime: result.get("goodput_ratio") for regime, result in results.items()},
        "adaptive_over_best": {
            regime: result["adaptive_over_best"] for regime, result in results.items()
        },
        "regimes": results,
        "config": _jsonable(vars(args)),
        "model_dir": str(model_dir),
        "duration_s": time.time() - started,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def report(args: argparse.Namespace) -> int:
    """Run, then say where the records went (stderr) and print the headline as one JSON line
    (`pdserve bench`); the exit code."""
    summary = run_benchmark(args)
    print(
        f"pdserve bench: per-request records in {args.out / 'raw'}, summary in "
        f"{args.out / 'summary.json'}, plots in {args.out}; redraw the plots with "
        f"`python -m benchmarks.goodput.replot {args.out / 'summary.json'}`",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "main_regime",
                    "goodput_disaggregated",
                    "goodput_colocated",
                    "goodput_ratio",
                    "goodputs",
                    "ratios",
                    "adaptive_over_best",
                    "duration_s",
                )
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return report(parse_bench_args(argv))
