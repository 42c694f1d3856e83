"""PNG plots of one regime (matplotlib, Agg): every layout or target on every chart; titles
say whether the regime is synthetic or which real data it comes from (workloads.regime_label).

    {regime}_attainment_vs_rate.png    attainment against rate per device, 90% line, goodputs
    {regime}_attainment_vs_scale.png   attainment against SLO scale at one shared rate
    {regime}_latency_cdf.png           TTFT and TPOT CDFs at that rate, SLOs marked
    {regime}_ttft_breakdown.png        mean TTFT split into stages, stacked, per layout and rate
    {regime}_placements.png            an adaptive layout only: per rate, each request by arrival
                                       (local or remote, at its prompt length) and the number of
                                       instances taking remote prefills over time
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.goodput.placements import role_changes
from benchmarks.goodput.report import common_rate, point_at
from benchmarks.goodput.sweep import RatePoint
from benchmarks.goodput.workloads import regime_label
from planner.metrics import ATTAINMENT_TARGET, SLOs, attainment, breakdown, tpot, ttft

COLORS = {
    "disaggregated": "tab:blue",
    "colocated": "tab:orange",
    "adaptive": "tab:green",
    "colocated-slo": "tab:purple",
}
KIND_COLORS = {"local": "tab:green", "remote": "tab:purple", "": "gray"}  # "": never placed
CLASS_MARKERS = ("o", "^", "s", "D")
TTFT_STAGES = ("router_queue", "prefill_queue", "prefill")
SCALES = [0.25 * k for k in range(1, 17)]
Layouts = dict[str, list[RatePoint]]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_regime(
    out_dir: Path,
    regime: str,
    points_by_layout: dict[str, list[RatePoint]],
    slos: SLOs,
    summary: dict[str, Any],
) -> list[str]:
    """Write the charts (four, and the placements of an adaptive layout); their file names."""
    plt = _pyplot()
    goodputs = [summary.get(f"goodput_{layout}", 0.0) or 0.0 for layout in points_by_layout]
    shared = common_rate(points_by_layout, max(goodputs))
    names = [_attainment_vs_rate(plt, out_dir, regime, points_by_layout, slos, summary)]
    if shared is not None:
        names.append(_attainment_vs_scale(plt, out_dir, regime, points_by_layout, slos, shared))
        names.append(_latency_cdf(plt, out_dir, regime, points_by_layout, slos, shared))
    names.append(_ttft_breakdown(plt, out_dir, regime, points_by_layout))
    placed = {
        layout: points
        for layout, points in points_by_layout.items()
        if any(r.placement_kind for p in points for r in p.records)
    }
    if placed:
        names.append(_placements(plt, out_dir, regime, placed))
    return names


def _save(plt: Any, figure: Any, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path.name


def _attainment_vs_rate(
    plt: Any,
    out_dir: Path,
    regime: str,
    points_by_layout: Layouts,
    slos: SLOs,
    summary: dict[str, Any],
) -> str:
    figure, axis = plt.subplots(figsize=(6, 4))
    for layout, points in points_by_layout.items():
        ordered = sorted(points, key=lambda p: p.rate)
        axis.plot(
            [p.rate_per_device for p in ordered],
            [100 * attainment(p.records, slos) for p in ordered],
            "o-",
            color=COLORS.get(layout),
            label=layout,
        )
        rate = summary.get(f"goodput_{layout}")
        if rate:
            axis.axvline(rate, color=COLORS.get(layout), linestyle=":", linewidth=1)
    axis.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle="--", linewidth=1)
    ratio, over_best = summary.get("goodput_ratio"), summary.get("adaptive_over_best")
    notes = [f"goodput ratio {ratio:.2f}x"] if ratio else []
    notes += [f"adaptive {over_best:.2f}x the best fixed"] if over_best else []
    title = f"{regime_label(regime)}: SLO attainment" + (f" ({'; '.join(notes)})" if notes else "")
    axis.set(
        xlabel="rate per device (requests/s)",
        ylabel="SLO attainment (%)",
        title=title,
        ylim=(-2, 102),
    )
    axis.legend()
    return _save(plt, figure, out_dir / f"{regime}_attainment_vs_rate.png")


def _attainment_vs_scale(
    plt: Any, out_dir: Path, regime: str, points_by_layout: Layouts, slos: SLOs, rate: float
) -> str:
    figure, axis = plt.subplots(figsize=(6, 4))
    for layout, points in points_by_layout.items():
        records = point_at(points, rate).records
        axis.plot(
            SCALES,
            [100 * attainment(records, slos, scale) for scale in SCALES],
            "o-",
            color=COLORS.get(layout),
            label=layout,
        )
    axis.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle="--", linewidth=1)
    axis.set(
        xlabel="SLO scale s (TTFT <= s*TTFT_SLO, TPOT <= s*TPOT_SLO)",
        ylabel="SLO attainment (%)",
        ylim=(-2, 102),
        title=f"{regime_label(regime)}: attainment vs SLO scale at {rate:.2f} req/s/device",
    )
    axis.legend()
    return _save(plt, figure, out_dir / f"{regime}_attainment_vs_scale.png")


def _cdf(axis: Any, values: list[float], color: str | None, label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.step(
            ordered,
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            color=color,
            label=label,
        )


def _latency_cdf(
    plt: Any, out_dir: Path, regime: str, points_by_layout: Layouts, slos: SLOs, rate: float
) -> str:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for layout, points in points_by_layout.items():
        done = [r for r in point_at(points, rate).records if r.ok]
        _cdf(axes[0], [ttft(r) for r in done], COLORS.get(layout), layout)
        _cdf(axes[1], [tpot(r) for r in done], COLORS.get(layout), layout)
    styles = iter(("--", ":", "-.", (0, (1, 3))))
    for slo_class, (ttft_slo, tpot_slo) in slos.by_class.items():
        style, suffix = next(styles), f" ({slo_class})" if slo_class else ""
        for axis, limit, name in ((axes[0], ttft_slo, "TTFT"), (axes[1], tpot_slo, "TPOT")):
            axis.axvline(
                limit, color="gray", linestyle=style, linewidth=1, label=f"{name} SLO{suffix}"
            )
    for axis, name in ((axes[0], "TTFT"), (axes[1], "TPOT")):
        axis.set(
            xlabel=f"{name} (s)",
            ylabel="fraction of requests",
            title=f"{regime_label(regime)}: {name} CDF at {rate:.2f} req/s/device",
        )
        axis.legend()
    return _save(plt, figure, out_dir / f"{regime}_latency_cdf.png")


def _ttft_breakdown(plt: Any, out_dir: Path, regime: str, points_by_layout: Layouts) -> str:
    """Mean TTFT per (layout, rate) as stacked stages; "other" is the client-measured TTFT
    the stages do not cover (gRPC, router dispatch, event polling)."""
    labels, stacks = [], []
    for layout, points in points_by_layout.items():
        for point in sorted(points, key=lambda p: p.rate):
            done = [r for r in point.records if r.ok]
            if not done:
                continue
            parts = [sum(breakdown(r)[s] for r in done) / len(done) for s in TTFT_STAGES]
            mean_ttft = sum(ttft(r) for r in done) / len(done)
            stacks.append([*parts, max(0.0, mean_ttft - sum(parts))])
            labels.append(f"{layout[:6]}\n{point.rate_per_device:.2f}")
    figure, axis = plt.subplots(figsize=(max(6, 0.7 * len(labels) + 2), 4))
    bottoms = [0.0] * len(stacks)
    for index, stage in enumerate((*TTFT_STAGES, "other")):
        heights = [stack[index] for stack in stacks]
        axis.bar(range(len(stacks)), heights, bottom=bottoms, label=stage)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=False)]
    axis.set_xticks(range(len(labels)), labels, fontsize=7)
    axis.set(
        ylabel="mean TTFT (s)",
        xlabel="layout, rate per device (req/s)",
        title=f"{regime_label(regime)}: where the time to first token goes",
    )
    axis.legend(fontsize=8)
    return _save(plt, figure, out_dir / f"{regime}_ttft_breakdown.png")


def _placements(plt: Any, out_dir: Path, regime: str, placed: Layouts) -> str:
    """One row per (adaptive layout, rate): each request at its arrival and prompt length,
    colored local or remote (marker by SLO class in a mix), and on the right axis the number of
    instances taking remote prefills, as the router reported it with each placement."""
    rows = [
        (layout, point)
        for layout, points in placed.items()
        for point in sorted(points, key=lambda p: p.rate)
    ]
    figure, axes = plt.subplots(len(rows), 1, figsize=(10, 2.4 * len(rows) + 0.6), squeeze=False)
    for axis, (layout, point) in zip(axes[:, 0], rows, strict=True):
        records = point.records
        start = min(r.send_time for r in records)
        classes = sorted({r.slo_class for r in records})
        handles = []
        for kind, color in KIND_COLORS.items():
            for marker, slo_class in zip(CLASS_MARKERS, classes, strict=False):
                mine = [r for r in records if r.placement_kind == kind and r.slo_class == slo_class]
                if mine:
                    label = " ".join(filter(None, (kind or "unplaced", slo_class)))
                    handles.append(
                        axis.scatter(
                            [r.send_time - start for r in mine],
                            [r.prompt_len for r in mine],
                            s=14,
                            color=color,
                            marker=marker,
                            label=label,
                        )
                    )
        changes = role_changes(records)
        if changes:  # held from each change to the next, the last to the last arrival
            counts = [count for _, count in changes]
            end = max(r.send_time for r in records) - start
            roles = axis.twinx()
            handles += roles.step(
                [t for t, _ in changes] + [end],
                counts + counts[-1:],
                where="post",
                color="black",
                linewidth=1,
                label="remote-prefill instances",
            )
            top = max(2, *counts)
            roles.set(
                ylabel="remote-prefill\ninstances", ylim=(-0.2, top + 0.2), yticks=range(top + 1)
            )
        num_remote = sum(r.placement_kind == "remote" for r in records)
        axis.set(
            ylabel="prompt tokens",
            ylim=(0, None),
            title=f"{layout} at {point.rate_per_device:.2f} req/s/device: "
            f"{num_remote} of {len(records)} remote",
        )
        axis.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.1, 1.0))
    axes[-1, 0].set_xlabel("arrival (s since the point's first request)")
    figure.suptitle(f"{regime_label(regime)}: where each request was prefilled")
    return _save(plt, figure, out_dir / f"{regime}_placements.png")
