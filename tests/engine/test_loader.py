"""Model folders: sharded checkpoints, both RoPE config forms, EOS ids, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import checkpoint_files
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.models import SUPPORTED_ARCHITECTURES
from tests.tiny_models import load_hf_model

PROMPT = [5, 17, 33, 9, 100, 250, 7, 64, 81, 3, 44]


def prefill_logits(model_dir: str, dtype: str = "float64") -> torch.Tensor:
    runner = ModelRunner(EngineConfig(model_dir=model_dir, dtype=dtype, num_kv_blocks=8))
    return runner.execute(ScheduledBatch([SequenceChunk("r", PROMPT, 0, [0])]))


def copy_model(model_dir: str, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_sharded_checkpoint_loads_same_weights(tiny_model) -> None:
    single, sharded = tiny_model("llama"), tiny_model("llama", sharded=True)
    files = checkpoint_files(sharded)
    assert len(files) > 1 and all(f.suffix == ".safetensors" for f in files)
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    assert checkpoint_files(single) == [Path(single) / "model.safetensors"]
    assert torch.equal(prefill_logits(single), prefill_logits(sharded))


def test_old_and_new_rope_config_forms_agree(tiny_model, tmp_path: Path) -> None:
    new_form = copy_model(tiny_model("llama3"), tmp_path / "new")
    rope = json.loads((new_form / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    old_form = copy_model(str(new_form), tmp_path / "old")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    edit_config(old_form, rope_parameters=None, rope_theta=rope["rope_theta"], rope_scaling=scaling)
    assert "rope_parameters" not in json.loads((old_form / "config.json").read_text())

    old_config, new_config = (
        ModelConfig.from_model_dir(old_form),
        ModelConfig.from_model_dir(new_form),
    )
    assert old_config.rope_type == new_config.rope_type == "llama3"
    assert old_config.rope_theta == new_config.rope_theta == 500000.0
    assert old_config == new_config
    old_logits = prefill_logits(str(old_form))
    assert torch.equal(old_logits, prefill_logits(str(new_form)))
    with torch.no_grad():
        hf_logits = load_hf_model(str(old_form))(torch.tensor([PROMPT])).logits[0, -1]
    assert (old_logits[0] - hf_logits).abs().max().item() < 1e-9


def test_linear_rope_scaling_old_form(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "linear")
    edit_config(
        model_dir,
        rope_parameters=None,
        rope_theta=20000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    config = ModelConfig.from_model_dir(model_dir)
    assert config.rope_type == "linear" and config.rope_parameters["factor"] == 4.0
    with torch.no_grad():
        hf_logits = load_hf_model(str(model_dir))(torch.tensor([PROMPT])).logits[0, -1]
    assert (prefill_logits(str(model_dir))[0] - hf_logits).abs().max().item() < 1e-9


def test_unsupported_architecture_names_supported_ones(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "gpt")
    edit_config(model_dir, architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError) as excinfo:
        ModelConfig.from_model_dir(model_dir)
    message = str(excinfo.value)
    assert "FalconForCausalLM" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_rejected(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "dyn")
    edit_config(
        model_dir, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        ModelConfig.from_model_dir(model_dir)


def test_eos_ids_from_generation_config_then_config(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("qwen2"), tmp_path / "eos")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_model_dir(model_dir).eos_token_ids == (2, 7)
    (model_dir / "generation_config.json").unlink()
    assert ModelConfig.from_model_dir(model_dir).eos_token_ids == (2,)


def test_missing_tensor_is_named(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "missing")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        prefill_logits(str(model_dir))


def test_no_safetensors_is_a_clear_error(tiny_model, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "empty")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        prefill_logits(str(model_dir))


def test_kv_blocks_from_memory_budget(tiny_model) -> None:
    model_dir = tiny_model("mistral")  # 1 KV head of 16 dims, 2 layers
    spec_bytes = KVCacheSpec(2, 1, 16, 1, 16, torch.float32).bytes_per_block
    assert spec_bytes == 2 * 2 * 16 * 1 * 16 * 4
    config = EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=10 * spec_bytes + 5)
    runner = ModelRunner(config)
    assert runner.num_kv_blocks == 10
    assert runner.kv_cache.data.shape == (2, 2, 1, 10, 16, 16)  # head-major
    with pytest.raises(ValueError, match="too small"):
        ModelRunner(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=spec_bytes - 1))
