"""The GPU benchmarks' model: the 1.1B Llama shape (TinyLlama's), random weights, built directly
in bfloat16 on the device and saved once, so no float32 copy is ever made. `--preset 31m` gives
the small shape for a CPU smoke run.

    python -m benchmarks.gpu_model --model-dir DIR [--device cuda] [--preset 1b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.engine_speed import PRESETS


def build_bf16(model_dir: Path, preset: str = "1b", device: str = "cuda") -> Path:
    """The preset's Llama in bfloat16, weights from seed 0, saved once into `model_dir`."""
    if (model_dir / "config.json").is_file():
        return model_dir
    config = LlamaConfig(**PRESETS[preset], dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(model_dir))
    return model_dir


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--preset", choices=("1b", "31m"), default="1b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    build_bf16(args.model_dir, args.preset, args.device)
    config = json.loads((args.model_dir / "config.json").read_text())
    result = {"model_dir": str(args.model_dir), "preset": args.preset, **config}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
