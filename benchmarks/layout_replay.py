"""Replays a `pdserve bench --compare` run's recorded traffic through the cluster-level layout
search (router/adaptive/layout_model.py) and sets what it would have chosen beside what each fixed
layout measured at the same point: where the search would split, disaggregated should attain
more than colocated there, and where it stays local, not less.

    python3 -m benchmarks.layout_replay benchmarks/runs/goodput-YYYYmmdd-HHMMSS   (a pdserve bench run)

The search sees what the router would: each arrival, each local decode's TPOT when it ends, and
the TPOT so far of those still decoding (`--source`: the local decodes of the adaptive layout's records, or every request of the
colocated layout's, which is the local layout without the prefill gate). The model's speed and
decode bias are the run's calibration's (its unloaded prefill and decode step) over the
profile's. Per regime and point: the share of arrivals at which the search chose a split, its
last forecast of each split (share at risk, mean worst objective over its SLO), and the
measured attainment of colocated and disaggregated. A replay is open-loop: once the search
splits, the records that follow are still those of the layout that did not.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

from benchmarks.goodput.layouts import DEFAULT_LATENCY_PROFILE
from benchmarks.goodput.report import slos_of
from benchmarks.output import emit
from engine.slo import RequestSLO
from planner.metrics import RequestRecord, SLOs, attainment
from router.adaptive.latency_model import LatencyModel
from router.adaptive.layout_model import Arrival, LayoutModel, Running


def records_of(point: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for r in point["records"]]


def calibrated_model(raw: dict[str, Any], profile: Path) -> LatencyModel:
    """The profile's model at the speeds of the run's unloaded calibration."""
    model = LatencyModel.from_file(str(profile))
    slo = raw["slo"]
    classes = slo.get("classes", {})  # a mix: the class whose calibration prompt is longest
    calibration = (
        slo["calibration"]
        if "calibration" in slo
        else max((c["calibration"] for c in classes.values()), key=lambda c: c["prompt_len"])
    )
    n = int(calibration["prompt_len"])
    model.speed = calibration["prefill_s"] / model.prefill_s(n)
    model.decode_speed = 1e3 * calibration["decode_step_s"] / model.step.decode_stage_ms(1, n)
    return model


ARRIVAL, END = 0, 1


def _events(
    records: list[RequestRecord], slos: SLOs, start: float
) -> list[tuple[float, int, RequestRecord, tuple[float, float]]]:
    """What the router sees, in order: (at, ARRIVAL, record, (0, 0)), and when it ends (at,
    END, record, (its TTFT, its TPOT, each over its SLO))."""
    events = []
    for record in records:
        events.append((record.send_time - start, ARRIVAL, record, (0.0, 0.0)))
        times = record.token_times
        if times:
            ttft_slo_s, tpot_slo_s = slos.of(record)
            tpot = (times[-1] - times[0]) / (len(times) - 1) / tpot_slo_s if len(times) > 1 else 0.0
            ttft = (times[0] - record.send_time) / ttft_slo_s
            events.append((times[-1] - start, END, record, (ttft, tpot)))
    return sorted(events, key=lambda e: (e[0], e[1]))


def _running(
    records: list[RequestRecord], local: list[bool], slos: SLOs, start: float, at: float
) -> list[Running]:
    """The local requests decoding at `at` (since `start`): their first token out, not yet
    their last."""
    running = []
    for record, is_local in zip(records, local, strict=True):
        times = record.token_times
        if not is_local or not times or not times[0] - start <= at < times[-1] - start:
            continue
        seen = [t for t in times if t - start <= at]
        ttft_slo_s, tpot_slo_s = slos.of(record)
        tpot = (seen[-1] - seen[0]) / (len(seen) - 1) / tpot_slo_s if len(seen) > 1 else 0.0
        running.append(
            Running(
                record.send_time - start,
                len(seen),
                (times[0] - record.send_time) / ttft_slo_s,
                tpot,
            )
        )
    return running


def replay(
    raw: dict[str, Any], profile: Path, window_s: float, source: str = "adaptive"
) -> list[dict[str, Any]]:
    slos = slos_of(raw["slo"])
    layouts = raw["layouts"]
    num_instances = int(layouts["adaptive"].get("num_devices", 2))
    model = calibrated_model(raw, profile)
    fixed = {
        name: {
            round(p["rate"], 6): attainment(records_of(p), slos) for p in layouts[name]["points"]
        }
        for name in ("colocated", "disaggregated", "adaptive")
        if name in layouts
    }
    rows = []
    for point in sorted(layouts[source]["points"], key=lambda p: p["rate"]):
        layout = LayoutModel(model, window_s)
        records = records_of(point)
        start = records[0].send_time
        local = [source == "colocated" or r.placement_kind == "local" for r in records]
        chosen = []
        for at, kind, record, (ttft, tpot) in _events(records, slos, start):
            if kind == END:
                is_local = source == "colocated" or record.placement_kind == "local"
                layout.note_ended(at, is_local, record.send_time - start, ttft, tpot)
            else:
                objectives = RequestSLO(*slos.of(record))
                layout.note(Arrival(at, record.prompt_len, record.output_len, objectives))
                running = _running(records, local, slos, start, at)
                chosen.append(layout.update(num_instances, at, running))
        rows.append(
            {
                "rate_per_device": point["rate_per_device"],
                "split_share": sum(k > 0 for k in chosen) / len(chosen),
                "forecasts": [
                    {"prefill_instances": f.prefill_instances, "at_risk": f.at_risk, "load": f.load}
                    for f in layout.last
                ],
                "measured": {
                    name: by_rate.get(round(point["rate"], 6)) for name, by_rate in fixed.items()
                },
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a bench --compare output folder (raw/*.json.gz)")
    parser.add_argument("--profile", type=Path, default=DEFAULT_LATENCY_PROFILE)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument(
        "--source",
        choices=("adaptive", "colocated"),
        default="adaptive",
        help="whose records give the local decodes' TPOT",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"run": str(args.run), "regimes": {}}
    for path in sorted((args.run / "raw").glob("*.json.gz")):
        raw = json.loads(gzip.open(path).read())
        rows = replay(raw, args.profile, args.window_s, args.source)
        result["regimes"][raw["regime"]] = rows
        for row in rows:
            measured = " ".join(f"{k} {v:.2f}" for k, v in row["measured"].items() if v is not None)
            forecasts = " ".join(
                f"k={f['prefill_instances']} {f['at_risk']:.2f}/{f['load']:.2f}"
                for f in row["forecasts"]
            )
            print(
                f"{raw['regime']:>13} {row['rate_per_device']:5.2f}/dev split "
                f"{row['split_share']:4.0%}  {forecasts:<32}  measured {measured}"
            )
    emit(result, args.out)


if __name__ == "__main__":
    main()
