"""Shared fixtures: one torch thread per test process, and cached tiny HF models."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)

# KV channels match strictly in posting order, as NCCL does, on gloo too: a hand-off that relied
# on tags would pass here and fail on GPUs. Spawned workers inherit it. "0" turns it off.
os.environ.setdefault("PDSERVE_KV_ORDERED_MATCHING", "1")
# Without CUDA the Triton kernels (engine/kernels/) run in Triton's interpreter; it is chosen when
# a kernel is defined, so before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model(family, sharded=False, **overrides) -> model_dir`, built once per session."""
    built: dict[tuple[Any, ...], str] = {}

    def get(family: str = "llama", sharded: bool = False, **overrides: Any) -> str:
        key = (family, sharded, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_tiny_model(
                tmp_path_factory.mktemp(family), family, sharded=sharded, **overrides
            )
        return built[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.gpu` tests skip on machines without CUDA (CI, the CPU dev machines)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
