"""One TP rank's model runtime: the model, its KV cache, and turning a ScheduledBatch into logits.

The runner is the only owner of tensors. Per step it builds input ids, positions, the slot mapping
and the attention metadata once (vectorised over tokens), runs the model over the packed tokens,
and returns the logits of the chunks that asked to sample.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch

from engine import parallel
from engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    build_attention_metadata,
    select_backend,
)
from engine.attention.metadata import to_device
from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.cpu_linear import pack_linears
from engine.graphs import DecodeGraphs
from engine.kernels import check_runnable, triton_available
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_quant import quant_format
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.rank_device import bind_thread, rank_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long, in step order (decode chunks first)
    positions: torch.Tensor  # [num_tokens] long
    metadata: AttentionMetadata
    # [num_logits] long: the last token of each sampled chunk (its last num_draft + 1 tokens
    # for a speculative one, every token for an `all_logits` one), in batch order
    sample_indices: torch.Tensor


def runner_device(config: EngineConfig, tp_rank: int) -> torch.device:
    """CPU, or on CUDA the GPU the rank's runtime gave it (engine/rank_device.py)."""
    return rank_device(config.device, tp_rank)


class ModelRunner:
    """Builds the model and KV cache of TP rank `tp_rank` and runs steps on it.

    For tp_size > 1 the calling process must already be that rank of an initialised TP group
    (`engine.parallel.init_tp_group`); every rank of the group must call `execute` with the same
    batch, in the same order (the collectives inside the forward pair up across ranks).
    """

    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_size: int | None = None) -> None:
        tp_size = config.tensor_parallel_size if tp_size is None else tp_size
        if (parallel.tp_rank(), parallel.tp_size()) != (tp_rank, tp_size):
            raise RuntimeError(
                f"ModelRunner for TP rank {tp_rank}/{tp_size} needs the TP group set up first "
                f"(engine.parallel.init_tp_group); this process is rank "
                f"{parallel.tp_rank()}/{parallel.tp_size()}"
            )
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = runner_device(config, tp_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or 1)
        else:
            bind_thread(self.device)  # this thread; threads of its own bind it themselves
        self.dtype = config.torch_dtype
        self.model_config = ModelConfig.from_model_dir(config.model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.block_size = config.block_size
        self.backend = select_backend(self.device, self.block_size, config.attention_backend)
        kv_quant = quant_format(config.kv_cache_dtype, self.block_size, self.model_config.head_dim)
        if kv_quant is not None:  # an 8-bit cache: a back end that dequantizes it reads it
            if not self.backend.reads_quantized_kv:
                self.backend = TorchAttentionBackend(cuda=self.device.type == "cuda")
            self.backend.kv_quant = kv_quant
        self.model = load_model(
            self.model_config,
            config.model_dir,
            self.backend,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,
        )
        if config.packed_linears and self.device.type == "cpu":
            pack_linears(self.model)
        self.kv_cache = KVCache(self._kv_cache_spec(), self.device)
        self.model.bind_kv_cache(self.kv_cache)
        # float64 models return float64 logits (parity tests); everything else float32
        self.logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.model.fused_ops = fused_ops(config, self)  # before the graphs capture the forward
        self.decode_graphs = decode_graphs(config, self)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.spec.num_blocks

    def _kv_cache_spec(self) -> KVCacheSpec:
        num_kv_heads = self.model.num_local_kv_heads
        cfg = self.model_config
        num_blocks = self.config.num_kv_blocks or KVCacheSpec.num_blocks_for_budget(
            self.config.kv_cache_memory_bytes,
            cfg.num_layers,
            self.block_size,
            num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.config.kv_cache_dtype,
        )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} is too small for one KV "
                "block of this model; raise it or set num_kv_blocks"
            )
        return KVCacheSpec(
            num_layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            kv_dtype=self.config.kv_cache_dtype,
        )

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; logits [num_logits, vocab_size] of the sampled chunks, in batch order."""
        if not batch.chunks:
            return torch.empty(0, self.model_config.vocab_size, dtype=self.logits_dtype)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch.chunks):
            for chunk in batch.chunks:
                self._check_chunk(chunk)
            hidden = self.decode_graphs.run(batch.chunks)  # [num_chunks, hidden], batch order
            return self.model.compute_logits(hidden).to(self.logits_dtype)
        inputs = self.prepare_inputs(batch)
        with self.backend.step_context():
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        return logits.to(self.logits_dtype)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Tensors and metadata for one step, with decode chunks (1 new token) first."""
        chunks = batch.chunks
        for chunk in chunks:
            self._check_chunk(chunk)
        is_decode = [chunk.num_new_tokens == 1 for chunk in chunks]
        decodes = [i for i, d in enumerate(is_decode) if d]
        prefills = [i for i, d in enumerate(is_decode) if not d]
        order = decodes + prefills
        ordered = [chunks[i] for i in order]
        num_new_tokens = [c.num_new_tokens for c in ordered]
        metadata, positions = build_attention_metadata(
            [c.start_pos for c in ordered],
            num_new_tokens,
            [c.block_table for c in ordered],
            num_decodes=sum(is_decode),
            block_size=self.block_size,
            device=self.device,
        )
        token_ends = list(itertools.accumulate(num_new_tokens))
        last_token = [0] * len(chunks)
        for step_idx, batch_idx in enumerate(order):
            last_token[batch_idx] = token_ends[step_idx] - 1
        sample_indices = [
            index
            for i, c in enumerate(chunks)
            for index in range(last_token[i] - c.num_logits + 1, last_token[i] + 1)
        ]
        input_ids = list(itertools.chain.from_iterable(c.token_ids for c in ordered))
        return StepInputs(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.long), self.device),
            positions=positions,
            metadata=metadata,
            sample_indices=to_device(torch.tensor(sample_indices, dtype=torch.long), self.device),
        )

    def _check_chunk(self, chunk: SequenceChunk) -> None:
        if not chunk.token_ids:
            raise ValueError(f"request {chunk.request_id}: a chunk needs at least one token")
        if chunk.context_len > self.max_model_len:
            raise ValueError(
                f"request {chunk.request_id}: {chunk.context_len} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        if len(chunk.block_table) * self.block_size < chunk.context_len:
            raise ValueError(
                f"request {chunk.request_id}: block table of {len(chunk.block_table)} blocks cannot "
                f"hold {chunk.context_len} tokens (block_size {self.block_size})"
            )


def fused_ops(config: EngineConfig, runner: ModelRunner) -> bool:
    """Whether the model runs engine/models/fused_llama.py (where the family supports it)."""
    wanted = config.fused_ops
    if wanted is None:
        wanted = runner.device.type == "cuda" and triton_available()
    if not wanted:
        return False
    check_runnable(runner.device.type, "fused_ops")
    from engine.models import fused_llama

    return fused_llama.supports(runner.model)


def decode_graphs(config: EngineConfig, runner: ModelRunner) -> DecodeGraphs | None:
    """The fixed-shape decode path where it runs (see engine/graphs.py), captured on CUDA."""
    on_cuda = runner.device.type == "cuda"
    capture = (
        on_cuda
        and config.cuda_graphs
        and runner.tp_size == 1  # TP collectives inside a graph need a graph-safe all-reduce
        and runner.backend.handles_padding
    )
    fixed_shape = capture if config.fixed_shape_decode is None else config.fixed_shape_decode
    if not fixed_shape:
        return None
    graphs = DecodeGraphs(
        runner.model,
        runner.backend,
        runner.block_size,
        config.max_num_seqs,
        runner.max_model_len,
        runner.device,
    )
    if capture:
        try:
            graphs.capture()
        except RuntimeError as error:  # an op that waits for the GPU (MoE layers in float64)
            torch.cuda.synchronize(runner.device)
            warnings.warn(
                f"decode steps run eagerly: CUDA graph capture failed ({error})", stacklevel=2
            )
            return None
    return graphs
