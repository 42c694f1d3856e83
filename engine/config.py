"""Engine configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_quant import check_kv_cache_dtype
from engine.speculative.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """What one model runtime (one worker, all its TP ranks) is built with.

    The KV pool size comes from `num_kv_blocks` if given, else from `kv_cache_memory_bytes`.
    `max_num_batched_tokens` is the per-step token budget; a prompt longer than `chunk_size`
    is prefilled in chunks of at most `chunk_size` tokens (SARATHI-style chunked prefill).
    """

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    # How the KV cache stores keys and values: "auto" (the model's dtype), "fp8_e4m3" or "int8"
    # (8 bits with a float32 scale per block and KV head: engine/kv_quant.py).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    num_threads: int | None = None  # torch threads per rank on CPU; None = 1 per rank
    # How long one TP collective waits for the other ranks inside a step (a dead or stalled rank
    # turns into an error within it). Idle ranks wait for their next step without a deadline.
    tp_timeout_s: float = 120.0
    # Hold a prompt chunk back while it would make a running decode miss its TPOT SLO, until the
    # prompt's own TTFT SLO cannot wait (engine/slo.py). Only requests that carry SLOs take part.
    slo_scheduling: bool = False
    # Speculative decoding of running decodes (engine/speculative/); None: one token per step.
    speculative: SpeculativeConfig | None = None
    # GPU engine (docs/guides/gpu.md). Pure-decode steps on CUDA replay a CUDA graph per batch
    # bucket (engine/graphs.py, TP size 1, a back end that skips padding rows); False: eager.
    cuda_graphs: bool = True
    # Run pure-decode steps through the fixed-shape buffers: None = wherever CUDA graphs run;
    # True on CPU runs the same path eagerly (the parity tests cover its padding that way).
    fixed_shape_decode: bool | None = None
    # "auto", "torch", "triton" or "flash" (engine.attention.select_backend).
    attention_backend: str = "auto"
    # Fused RMSNorm with its residual add, SiLU x mul and rotary (engine/models/fused_llama.py):
    # None = on CUDA where triton is installed; True on CPU runs them in Triton's interpreter.
    fused_ops: bool | None = None
    # On CPU, linear layers run oneDNN over weights reordered once at load (engine/cpu_linear.py:
    # float32, and bfloat16 where native); False keeps F.linear (MKL).
    packed_linears: bool = True

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        checks = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "chunk_size": self.chunk_size,
        }
        for name, value in checks.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not (isinstance(self.tp_timeout_s, (int, float)) and 0 < self.tp_timeout_s < 1e6):
            raise ValueError(f"tp_timeout_s must be seconds in (0, 1e6), got {self.tp_timeout_s!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "flash"):
            raise ValueError(
                "attention_backend must be 'auto', 'torch', 'triton' or 'flash', "
                f"got {self.attention_backend!r}"
            )
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_size {self.chunk_size} must not exceed max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
