"""The figures of docs/results.md that `python -m benchmarks.check_results` re-measures.

Each figure names the results table's section, the command that measured it (the one the table
quotes), the key of that command's last-line JSON that holds it, the recorded value and a
tolerance: how far a run on the 2-core development machine may land from it and still count as
the same figure. Tolerances follow the run-to-run spread seen there: figures of one process's
arithmetic (block counts, byte ratios, perplexity ratios, hit rates) hold to a percent or two;
speed ratios of two engines measured in the same run move 8-15%; an absolute time moves with
whatever else runs on the machine, 25-30%.

`quick` is the variant --quick runs: extra arguments that measure the same figure with fewer
rounds or requests, or None where the command itself fits the check's budget. `in_quick` False:
the command takes too long for --quick (the full check runs it). docs/results.md carries the
table `tolerance_table()` prints; tests/benchmarks/test_check_results.py keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    name: str
    section: str  # the heading of docs/results.md it sits under
    command: tuple[str, ...]  # after `python -m`
    key: str  # dotted path into the command's last-line JSON
    recorded: float
    tolerance: float  # relative: |measured - recorded| <= tolerance * |recorded|
    quick: tuple[str, ...] | None = None  # extra arguments for --quick
    in_quick: bool = True
    seconds: float = 60.0  # about how long the command (its quick variant in --quick) takes

    def argv(self, quick: bool) -> list[str]:
        extra = list(self.quick) if quick and self.quick is not None else []
        return [*self.command, *extra]

    def moved(self, measured: float) -> bool:
        return abs(measured - self.recorded) > self.tolerance * abs(self.recorded)


KV_QUANT = ("benchmarks.kv_quant",)
SPECULATIVE = ("benchmarks.speculative",)
ROUTING = ("benchmarks.kv_routing",)

FIGURES: tuple[Figure, ...] = (
    Figure(
        "kv_quant.blocks_per_gb_ratio",
        "KV cache quantization",
        KV_QUANT,
        "blocks_per_gb_ratio",
        3.985,
        0.01,
        ("--quick",),
        seconds=100,
    ),
    Figure(
        "kv_quant.ppl_ratio_int8",
        "KV cache quantization",
        KV_QUANT,
        "ppl_ratio_int8",
        1.0027,
        0.01,
        ("--quick",),
        seconds=0,  # the same run as the figure above
    ),
    Figure(
        "kv_quant.decode_speed_ratio",
        "KV cache quantization",
        KV_QUANT,
        "decode_speed_ratio",
        0.798,
        0.1,
        ("--quick",),
        seconds=0,
    ),
    Figure(
        "kv_quant.handoff_time_ratio_8k",
        "KV cache quantization",
        KV_QUANT,
        "handoff_time_ratio_8k",
        0.286,
        0.3,
        ("--quick",),
        seconds=0,
    ),
    Figure(
        "speculative.speedup_copy_b1",
        "Speculative decoding",
        SPECULATIVE,
        "speedup_copy_b1",
        1.87,
        0.1,
        seconds=480,
    ),
    Figure(
        "speculative.acceptance_copy",
        "Speculative decoding",
        SPECULATIVE,
        "acceptance_copy",
        0.77,
        0.05,
        seconds=0,
    ),
    Figure(
        "kv_routing.hit_rate_kv_aware",
        "Prefix-aware routing",
        ROUTING,
        "hit_rate.kv_aware",
        0.86,
        0.02,
        in_quick=False,
        seconds=240,
    ),
    Figure(
        "sliding_window_kv.read_ratio",
        "Model families, CPU",
        ("benchmarks.sliding_window_kv",),
        "read_ratio",
        4.541,
        0.01,
        seconds=15,
    ),
    Figure(
        "window_release_kv.ratio",
        "Model families, CPU",
        ("benchmarks.window_release_kv",),
        "ratio",
        8.062,
        0.01,
        seconds=10,
    ),
    Figure(
        "router_load.tokens_per_s_ratio_to_baseline",
        "Router",
        ("benchmarks.router_load",),
        "tokens_per_s_ratio_to_baseline",
        0.996,
        0.08,
        seconds=40,
    ),
    Figure(
        "http_front.http_to_grpc_tokens_per_s_ratio",
        "HTTP front end",
        ("benchmarks.http_front",),
        "http_to_grpc_tokens_per_s_ratio",
        0.995,
        0.08,
        seconds=40,
    ),
    Figure(
        "cold_start.cold_start_s",
        "Recovery and load",
        ("benchmarks.cold_start", "--no-ray"),
        "cold_start_s",
        10.06,
        0.3,
        seconds=40,
    ),
)


def by_command(figures: tuple[Figure, ...], quick: bool) -> dict[tuple[str, ...], list[Figure]]:
    """The figures grouped by the command line that measures them (one run serves a group)."""
    groups: dict[tuple[str, ...], list[Figure]] = {}
    for figure in figures:
        if quick and not figure.in_quick:
            continue
        groups.setdefault(tuple(figure.argv(quick)), []).append(figure)
    return groups


def tolerance_table() -> str:
    """The markdown table docs/results.md ends its figures with."""
    rows = [
        "| figure | command | recorded | tolerance | in --quick |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in FIGURES:
        command = " ".join(("python -m", *f.command))
        quick = "no" if not f.in_quick else (" ".join(f.quick) if f.quick else "as is")
        rows.append(f"| `{f.name}` | `{command}` | {f.recorded:g} | ±{f.tolerance:.0%} | {quick} |")
    return "\n".join(rows)
