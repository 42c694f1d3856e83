"""Replays a `pdserve bench --compare` run's recorded arrivals through the cluster-level layout
search (router/layout_model.py) and sets what it would have chosen beside what each fixed
layout measured at the same point: where the search would split, disaggregated should attain
more than colocated there, and where it stays local, not less.

    python3 -m benchmarks.layout_replay benchmarks/results/goodput-2core/adaptive-session13-A

The model's speed is the one the router would have learned: the adaptive layout's measured
prefill compute over the profile's at the run's lowest rate. Per regime and point: the share of
arrivals at which the search chose a split, its last forecast of each layout (share at risk,
mean worst objective over its SLO), and the measured attainment of colocated and disaggregated.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.goodput.layouts import DEFAULT_LATENCY_PROFILE
from benchmarks.output import emit
from engine.slo import RequestSLO
from router.latency_model import LatencyModel
from router.layout_model import Arrival, LayoutModel


def slo_of(record: dict[str, Any], slo: dict[str, Any]) -> RequestSLO:
    objectives = slo.get("classes", {}).get(record.get("slo_class") or "", slo)
    return RequestSLO(objectives["ttft_s"], objectives["tpot_s"])


def met(record: dict[str, Any], slo: RequestSLO) -> bool:
    times = record["token_times"]
    if record.get("error") or not times:
        return False
    tpot_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - record["send_time"] <= slo.ttft_s and tpot_s <= slo.tpot_s


def attainment(point: dict[str, Any], slo: dict[str, Any]) -> float:
    records = point["records"]
    return sum(met(r, slo_of(r, slo)) for r in records) / len(records)


def replay(raw: dict[str, Any], profile: Path, window_s: float) -> list[dict[str, Any]]:
    slo = raw["slo"]
    layouts = raw["layouts"]
    adaptive = sorted(layouts["adaptive"]["points"], key=lambda p: p["rate"])
    model = LatencyModel.from_file(str(profile))
    lowest = adaptive[0]["records"]
    measured = statistics.mean(r["timings"]["prefill_s"] for r in lowest)
    model.speed = measured / statistics.mean(model.prefill_s(r["prompt_len"]) for r in lowest)
    fixed = {
        name: {round(p["rate"], 6): attainment(p, slo) for p in layouts[name]["points"]}
        for name in ("colocated", "disaggregated") if name in layouts
    }  # fmt: skip
    rows = []
    for point in adaptive:
        layout = LayoutModel(model, window_s)
        records = point["records"]
        start = records[0]["send_time"]
        chosen = []
        for record in records:
            at = record["send_time"] - start
            layout.note(Arrival(at, record["prompt_len"], record["output_len"],
                                slo_of(record, slo)))  # fmt: skip
            chosen.append(layout.update(layout_instances(raw), at))
        rows.append({
            "rate_per_device": point["rate_per_device"],
            "split_share": sum(k > 0 for k in chosen) / len(chosen),
            "forecasts": [
                {"prefill_instances": f.prefill_instances, "at_risk": f.at_risk, "load": f.load}
                for f in layout.last
            ],
            "measured": {name: by_rate.get(round(point["rate"], 6))
                         for name, by_rate in fixed.items()},
            "adaptive_measured": attainment(point, slo),
        })  # fmt: skip
    return rows


def layout_instances(raw: dict[str, Any]) -> int:
    return int(raw["layouts"]["adaptive"].get("num_devices", 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a bench --compare output folder (raw/*.json.gz)")
    parser.add_argument("--profile", type=Path, default=DEFAULT_LATENCY_PROFILE)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"run": str(args.run), "regimes": {}}
    for path in sorted((args.run / "raw").glob("*.json.gz")):
        raw = json.loads(gzip.open(path).read())
        rows = replay(raw, args.profile, args.window_s)
        result["regimes"][raw["regime"]] = rows
        for row in rows:
            measured = " ".join(f"{k} {v:.2f}" for k, v in row["measured"].items() if v is not None)
            forecasts = " ".join(f"k={f['prefill_instances']} {f['at_risk']:.2f}/{f['load']:.2f}"
                                 for f in row["forecasts"])  # fmt: skip
            print(f"{raw['regime']:>13} {row['rate_per_device']:5.2f}/dev split "
                  f"{row['split_share']:4.0%}  {forecasts:<32}  measured {measured}")  # fmt: skip
    emit(result, args.out)


if __name__ == "__main__":
    main()
