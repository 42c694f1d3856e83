"""`pdserve plan`: search placements for a workload and SLOs, from a measured profile.

deploy/cli/main.py forwards `pdserve plan ARGS` to `main(ARGS)`. `plan` only computes (numpy
and the planner); the profile it reads comes from `pdserve profile` (benchmarks/profiling/).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def main(argv: list[str] | None = None, prog: str = "pdserve plan") -> int:
    """`pdserve plan ARGS` forwards ARGS here (deploy/cli/main.py)."""
    return cmd_plan(build_parser(prog).parse_args(argv))


def build_parser(prog: str = "pdserve plan") -> argparse.ArgumentParser:
    plan = argparse.ArgumentParser(
        prog=prog, description="Search placements for a workload and SLOs."
    )
    plan.add_argument("--profile", required=True, help="profile JSON (DistServe's shape)")
    plan.add_argument("--model", help="the model in the profile file (when it has several)")
    plan.add_argument(
        "--colocated-profile", help="profile for the colocated layout (default: --profile)"
    )
    plan.add_argument("--max-num-tokens", help="DistServe's max_num_tokens.csv (KV memory)")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--gpus-per-node", type=int, default=1)
    plan.add_argument(
        "--workload",
        default="chatbot",
        help="chatbot | code | summarization, or a JSON list of [prompt, output]",
    )
    plan.add_argument("--num-requests", type=int, default=500)
    plan.add_argument("--max-model-len", type=int, default=1024)
    plan.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    plan.add_argument("--cv", type=float, default=1.0)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--ttft-ms", type=float, required=True)
    plan.add_argument("--tpot-ms", type=float, required=True)
    plan.add_argument("--attainment", type=float, default=0.9)
    plan.add_argument("--criterion", choices=("joint", "separate"), default="joint")
    plan.add_argument(
        "--pp",
        default=None,
        help="pipeline depths to try, e.g. 1,2,4 (default "
        "1,2,4,8; 1 with --write: pdserve serves pp=1)",
    )
    plan.add_argument("--cross-node-gbps", type=float, help="price KV transfer across nodes")
    plan.add_argument("--intra-node-GBps", type=float, default=300.0)
    plan.add_argument("--colocated-policy", choices=("vllm", "chunked"), default="chunked")
    plan.add_argument(
        "--colocated-fill",
        action="store_true",
        help="the colocated layout as replicas filling the cluster (default: one)",
    )
    plan.add_argument("--write", help="write the best placement as a serve config (YAML)")
    plan.add_argument("--base-config", help="serve config whose other keys the written one keeps")
    return plan


def _workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from planner.workload import make_workload, synthetic_workload

    if args.workload.endswith(".json"):
        with open(args.workload, encoding="utf-8") as handle:
            data = json.load(handle)
        # a list of [prompt, output] lengths, or a lengths file with them under "pairs"
        # (benchmarks/data/sharegpt-lengths.json)
        pairs = [(int(p), int(o)) for p, o in (data["pairs"] if isinstance(data, dict) else data)]
        return make_workload(
            args.workload,
            pairs,
            args.num_requests,
            arrival=args.arrival,
            cv=args.cv,
            seed=args.seed,
        )
    return synthetic_workload(
        args.workload,
        args.num_requests,
        args.max_model_len,
        arrival=args.arrival,
        cv=args.cv,
        seed=args.seed,
    )


def _load(args: argparse.Namespace, path: str):  # type: ignore[no-untyped-def]
    from planner.profile import load_profile, with_max_num_tokens

    profile = load_profile(path, args.model)
    return with_max_num_tokens(profile, args.max_num_tokens) if args.max_num_tokens else profile


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.search import SLO, Cluster, SearchSettings, plan
    from planner.serving_path import apply_serving_path, measured_link, relay_of, ttft_path_ms
    from planner.sim_spec import LinkSpec, SimOptions

    profile = _load(args, args.profile)
    coloc = _load(args, args.colocated_profile) if args.colocated_profile else None
    pp_text = args.pp or ("1" if args.write else "1,2,4,8")
    link = None
    first = next(iter(profile.by_tp.values()))
    kv = first.kv_bytes_per_token
    if args.cross_node_gbps and kv:
        link = LinkSpec(kv, args.intra_node_GBps, args.cross_node_gbps / 8.0)
    else:  # the channel `pdserve profile` measured in this deployment, if it did
        link = measured_link(first)
    # A profile measured with `pdserve profile --path` carries the serving path's costs.
    options = SimOptions(colocated_policy=args.colocated_policy, ttft_path_ms=ttft_path_ms(profile))
    settings = SearchSettings(
        link=link,
        pp_choices=tuple(int(p) for p in pp_text.split(",")),
        options=options,
        relay=relay_of(profile),
        colocated_fill=args.colocated_fill,
    )
    profile = apply_serving_path(profile)
    coloc = apply_serving_path(coloc) if coloc else None
    slo = SLO(args.ttft_ms, args.tpot_ms, args.attainment, args.criterion)
    cluster = Cluster(args.nodes, args.gpus_per_node)
    result = plan(profile, _workload(args), slo, cluster, settings, colocated_profile=coloc)
    summary = _summary(result)
    if args.write:
        _write(args, result.best.placement, summary)
        summary["written"] = args.write
    print(json.dumps(summary))
    return 0


def _summary(result: Any) -> dict[str, Any]:
    def one(scored: Any) -> dict[str, Any] | None:
        if scored is None:
            return None
        return {
            "placement": scored.placement.describe(),
            "algorithm": scored.placement.algorithm,
            "per_gpu_goodput": round(scored.per_gpu_rate, 4),
            "gpus": scored.placement.num_gpus,
        }

    return {
        "best": one(result.best),
        "best_disaggregated": one(result.best_disaggregated),
        "best_colocated": one(result.best_colocated),
        "disaggregated_over_colocated": round(result.winner_ratio, 3),
        "search_s": round(result.search_s, 2),
    }


def _write(args: argparse.Namespace, placement: Any, summary: dict[str, Any]) -> None:
    import yaml

    from planner.serve_config import write_serve_config

    base: dict[str, Any] = {}
    if args.base_config:
        with open(args.base_config, encoding="utf-8") as handle:
            base = yaml.safe_load(handle) or {}
    comment = f"written by pdserve plan: {json.dumps(summary['best'])}"
    write_serve_config(args.write, placement, base, comment)
