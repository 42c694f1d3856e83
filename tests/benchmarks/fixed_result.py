"""A stand-in benchmark for tests of benchmarks.check_results: writes {"speed": {"ratio": X}}
to --out, X from --value, and exits with --exit-code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--value", type=float, default=2.0)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--out", required=True)
args = parser.parse_args()
line = json.dumps({"speed": {"ratio": args.value}})
Path(args.out).write_text(line + "\n")
print(line)
sys.exit(args.exit_code)
