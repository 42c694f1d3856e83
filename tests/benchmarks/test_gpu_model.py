"""benchmarks/gpu_model.py builds its model folder whole or not at all, on the tiny shape."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from benchmarks import gpu_model


def build(model_dir: Path) -> Path:
    return gpu_model.build_bf16(model_dir, preset="tiny", device="cpu")


def test_a_folder_with_config_but_no_weights_is_rebuilt(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 7}))  # a killed old build
    assert not gpu_model.is_complete(model_dir)
    build(model_dir)
    assert gpu_model.is_complete(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 512
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_build_killed_while_saving_leaves_no_model_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "model"
    save = PreTrainedModel.save_pretrained

    def killed(self: PreTrainedModel, folder: str, **kwargs: object) -> None:
        Path(folder).mkdir(parents=True)
        (Path(folder) / "config.json").write_text("{}")  # config first, then the weights
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        build(model_dir)
    assert not model_dir.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"model.partial-{os.getpid()}"]
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    build(model_dir)  # the rerun removes the leftover and builds in full
    assert gpu_model.is_complete(model_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_complete_folder_is_kept_as_it_is(tmp_path: Path) -> None:
    model_dir = build(tmp_path / "model")
    weights = model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build(model_dir) == model_dir
    assert weights.stat().st_mtime_ns == stamp
