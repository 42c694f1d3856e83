"""planner/ is pure computation: importing all of it loads none of the serving packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("router", "prefill_worker", "decode_worker", "deploy", "grpc", "ray", "torch")


def test_planner_imports_no_serving_package() -> None:
    code = (
        "import sys, pkgutil, importlib, planner\n"
        "for m in pkgutil.iter_modules(planner.__path__): importlib.import_module('planner.' + m.name)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
