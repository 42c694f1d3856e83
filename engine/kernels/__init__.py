"""Triton kernels for the GPU engine: paged decode attention, the KV write, and fused small ops.

Every kernel reads and writes the engine's own layouts in place (the head-major KV cache of
engine/kv_cache.py, the packed [num_tokens, ...] activations of engine/models/llama.py), so no
gather, copy or padding surrounds a launch. Each has a torch reference it is tested against.

On a machine without CUDA the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1`,
set before this package is imported; tests/conftest.py sets it), which is how CI tests them.
Import this package only where it is used: `triton` is an optional dependency.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Whether the `triton` package is installed (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None


def check_runnable(device_type: str, what: str) -> None:
    """ValueError unless the kernels can run here: on CUDA, or in the interpreter."""
    if not triton_available():
        raise ValueError(f"{what} needs the triton package (pip install triton)")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{what} runs on CUDA; on CPU only in Triton's interpreter (TRITON_INTERPRET=1, "
            "set before the kernels are imported), which is for tests"
        )
