"""The GPU benchmarks' model: the 1.1B Llama shape (TinyLlama's), random weights, built directly
in bfloat16 on the device and saved once, so no float32 copy is ever made. `--preset 31m` gives
the small shape for a CPU smoke run, `--preset tiny` the test models' size (hidden 64, 2 layers)
for `gpu_checks.sh --dry-run`.

The model is saved into a sibling folder `<name>.partial-<pid>` and renamed into place once
complete, so a build killed half way never leaves a folder that a rerun trusts. A folder with
config.json but missing weights (left by an older build) is rebuilt; stale `.partial-*` siblings
are removed first.

    python -m benchmarks.gpu_model --model-dir DIR [--device cuda] [--preset 1b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.engine_speed import MODEL_CONFIG, PRESETS
from benchmarks.goodput.layouts import TINY_MODEL

SHAPES: dict[str, dict[str, Any]] = {
    "1b": PRESETS["1b"],
    "31m": PRESETS["31m"],
    "tiny": {**MODEL_CONFIG, "vocab_size": 512, **TINY_MODEL},
}


def is_complete(model_dir: Path) -> bool:
    """config.json and every weight file it needs: one model.safetensors, or each index shard."""
    if not (model_dir / "config.json").is_file():
        return False
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((model_dir / shard).is_file() for shard in shards)
    return (model_dir / "model.safetensors").is_file()


def build_bf16(model_dir: Path, preset: str = "1b", device: str = "cuda") -> Path:
    """The preset's Llama in bfloat16, weights from seed 0, saved once into `model_dir`."""
    if is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.parent.glob(f"{model_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
    config = LlamaConfig(**SHAPES[preset], dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(partial))
    del model
    if model_dir.exists():  # incomplete (checked above): an older build's leftovers
        shutil.rmtree(model_dir)
    os.rename(partial, model_dir)  # same parent, same file system: atomic
    return model_dir


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    build_bf16(args.model_dir, args.preset, args.device)
    config = json.loads((args.model_dir / "config.json").read_text())
    result = {"model_dir": str(args.model_dir), "preset": args.preset, **config}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
