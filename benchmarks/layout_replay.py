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
from benchmarks.goodput.report import slos_of
from benchmarks.output import emit
from engine.slo import RequestSLO
from planner.metrics import RequestRecord, attainment
from router.latency_model import LatencyModel
from router.layout_model import Arrival, LayoutModel


def records_of(point: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for r in point["records"]]


def replay(raw: dict[str, Any], profile: Path, window_s: float) -> list[dict[str, Any]]:
    slos = slos_of(raw["slo"])
    layouts = raw["layouts"]
    adaptive = sorted(layouts["adaptive"]["points"], key=lambda p: p["rate"])
    num_instances = int(layouts["adaptive"].get("num_devices", 2))
    model = LatencyModel.from_file(str(profile))
    lowest = records_of(adaptive[0])
    measured = statistics.mean(r.timings["prefill_s"] for r in lowest)
    model.speed = measured / statistics.mean(model.prefill_s(r.prompt_len) for r in lowest)
    fixed = {
        name: {round(p["rate"], 6): attainment(records_of(p), slos) for p in layouts[name]["points"]}
        for name in ("colocated", "disaggregated") if name in layouts
    }  # fmt: skip
    rows = []
    for point in adaptive:
        layout = LayoutModel(model, window_s)
        records = records_of(point)
        start = records[0].send_time
        chosen = []
        for record in records:
            at = record.send_time - start
            objectives = RequestSLO(*slos.of(record))
            layout.note(Arrival(at, record.prompt_len, record.output_len, objectives))
            chosen.append(layout.update(num_instances, at))
        rows.append({
            "rate_per_device": point["rate_per_device"],
            "split_share": sum(k > 0 for k in chosen) / len(chosen),
            "forecasts": [
                {"prefill_instances": f.prefill_instances, "at_risk": f.at_risk, "load": f.load}
                for f in layout.last
            ],
            "measured": {name: by_rate.get(round(point["rate"], 6))
                         for name, by_rate in fixed.items()},
            "adaptive_measured": attainment(records, slos),
        })  # fmt: skip
    return rows


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
