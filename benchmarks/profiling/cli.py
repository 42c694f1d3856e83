"""`pdserve profile` (or `python -m benchmarks.profiling`): measure this machine for the planner.

deploy/cli/main.py forwards `pdserve profile ARGS` to `main(ARGS)`; steps.py does the work.
"""

from __future__ import annotations

import argparse


def build_parser(prog: str = "pdserve profile") -> argparse.ArgumentParser:
    profile = argparse.ArgumentParser(
        prog=prog, description="Measure this deployment's latency model (for `pdserve plan`)."
    )
    profile.add_argument("--config", help="serve config (model, dtype, device, KV cache)")
    profile.add_argument("--out", required=True, help="profile JSON to write")
    profile.add_argument("--tp", default="1", help="TP sizes to measure, e.g. 1,2")
    profile.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    profile.add_argument(
        "--bench-model",
        metavar="DIR",
        help="profile `pdserve bench`'s model (built in DIR) with its engine "
        "settings instead of --config's",
    )
    profile.add_argument(
        "--clock",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="auto: the process's CPU time for TP=1 on CPU, else wall time",
    )
    profile.add_argument(
        "--path",
        action="store_true",
        help="also measure the serving path (router, gRPC, client) at TP=1",
    )
    profile.add_argument("--no-transfer", action="store_true", help="skip the KV transfer")
    profile.add_argument("--raw-out", help="also write the measured points (JSON)")
    return profile


def main(argv: list[str] | None = None, prog: str = "pdserve profile") -> int:
    from benchmarks.profiling.steps import run_profile  # torch and the engine: only when measuring

    return run_profile(build_parser(prog).parse_args(argv))
