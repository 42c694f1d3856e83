"""Shared fixtures for the router tests: a tiny model folder with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from router.tokenizer import RouterTokenizer
from tests.router.tiny_tokenizer import add_tiny_tokenizer
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("router_model"), family="llama")
    return add_tiny_tokenizer(Path(model_dir))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: str) -> RouterTokenizer:
    return RouterTokenizer(tiny_model_dir)
