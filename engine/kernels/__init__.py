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


def triton_available() -> bool:
    """Whether the `triton` package is installed (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None
