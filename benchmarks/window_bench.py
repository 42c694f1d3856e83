"""What the two sliding-window benchmarks share: their flags, and the engine over one long prompt."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine import LLM


def parse_window_args(
    argv: list[str] | None, description: str, decode_tokens: int
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=decode_tokens)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.max_positions = args.context + args.decode_tokens + 16
    return args


def default_model_dir(args: argparse.Namespace, family: str) -> Path:
    return args.model_dir or Path.home() / ".cache" / "pdserve" / f"bench-{family}-w{args.window}"


def long_prompt(args: argparse.Namespace) -> list[int]:
    """A fixed random prompt of `--context` tokens."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, 4096, (args.context,), generator=generator).tolist()


def open_llm(args: argparse.Namespace, model_dir: Path) -> LLM:
    """One thread, no prefix cache: each measurement prefills the whole prompt itself."""
    return LLM(
        str(model_dir),
        block_size=args.block_size,
        enable_prefix_caching=False,
        max_model_len=args.max_positions,
        num_threads=1,
    )
