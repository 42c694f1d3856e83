"""Build a model from a Hugging Face folder and load its safetensors, each TP rank its own slices.

Checkpoint layouts: `model.safetensors`, or shards listed in `model.safetensors.index.json`.
Tensors are opened with `safe_open(...).get_slice`, so a rank reads from disk only the rows or
columns its parameters hold. Separate q/k/v and gate/up tensors are copied into their fused
parameters (see each layer's `weight_loader`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.attention import AttentionBackend
from engine.model_config import ModelConfig
from engine.models import get_model_class
from engine.models.llama import LlamaForCausalLM


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder, single-file or sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; pdserve loads safetensors checkpoints only"
        )
    return files


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    model_config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """An unloaded model for this TP rank (TP group already set up, see engine.parallel)."""
    model_class = get_model_class(model_config.architecture)
    with _default_dtype_and_device(dtype, device):
        model = model_class(model_config, backend, max_positions)
    # Every family extends LlamaForCausalLM: the runner and the loader use its interface
    # (bind_kv_cache, checkpoint_param, compute_logits, num_local_kv_heads).
    assert isinstance(model, LlamaForCausalLM), f"{model_class.__name__} must extend it"
    return model.eval()


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Copy this rank's slices of every checkpoint tensor into `model`; check nothing is missing."""
    params = dict(model.named_parameters())
    loaded_shards: dict[str, set[int]] = defaultdict(set)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as checkpoint:
            for checkpoint_name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                for param_name, shard_id, row_offset in model.checkpoint_targets(checkpoint_name):
                    if param_name not in params:
                        raise ValueError(f"{path.name}: unexpected tensor {checkpoint_name!r}")
                    param = params[param_name]
                    tensor_slice: Any = checkpoint.get_slice(checkpoint_name)
                    if row_offset:
                        tensor_slice = _RowsFrom(tensor_slice, row_offset)
                    loader = getattr(param, "weight_loader", None)
                    with torch.no_grad():
                        if loader is not None:
                            loader(param, tensor_slice, shard_id)
                        else:
                            _copy_whole(param, tensor_slice[:], checkpoint_name)
                    loaded_shards[param_name].add(shard_id)
    missing = [
        name
        for name, param in params.items()
        if len(loaded_shards[name]) != getattr(param, "num_shards", 1)
    ]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors for parameters {missing}")


class _RowsFrom:
    """A checkpoint slice seen from row `offset` on: one part of a fused tensor (Phi-3's
    qkv_proj, gate_up_proj) indexed as if it were a tensor of its own."""

    def __init__(self, source: Any, offset: int) -> None:
        self.source, self.offset = source, offset

    def __getitem__(self, key: Any) -> Any:
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(rows, slice) or rows.start is None or rows.stop is None:
            raise ValueError("a fused checkpoint tensor is read by row ranges only")
        shifted = slice(rows.start + self.offset, rows.stop + self.offset)
        return self.source[(shifted,) + tuple(rest)]


def _copy_whole(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.copy_(tensor)


def load_model(
    model_config: ModelConfig,
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    model = build_model(model_config, backend, dtype, device, max_positions)
    load_weights(model, model_dir)
    return model
