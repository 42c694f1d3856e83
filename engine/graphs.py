"""Fixed-shape decode steps: persistent input buffers, batch-size buckets and CUDA graphs.

A pure-decode step (every chunk one new token that it samples) of n sequences runs at the
smallest bucket >= n (1, 2, 4, 8, then multiples of 16 up to max_num_seqs) over buffers that
live as long as the runner, as vLLM and nano-vllm do:

    input_ids, positions, slot_mapping, context_lens  [max_bucket]
    block_tables                                      [max_bucket, max_blocks_per_seq]

Rows n..bucket-1 are padding: token 0 at position 0, slot -1 (no KV write) and context length 0
(zero attention output); their hidden rows are dropped. A step fills a pinned host copy of the
buffers and sends it with two non-blocking copies; the next step waits on an event recorded
after them before it rewrites the host copy (the sampler's one sync per step has nearly always
passed it already).

On CUDA (TP size 1, a back end that skips padding rows by itself: `handles_padding`) each bucket's
forward is captured once as a CUDA graph and replayed: the step costs one launch instead of a
launch per op. Anywhere else the same buffers run eagerly (`fixed_shape_decode=True` on CPU), so
the CPU parity tests cover the padding and buffer logic. Prefill and mixed steps always run
eagerly through ModelRunner.prepare_inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.batch import SequenceChunk

MAX_BUCKET = 512


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (itself the last bucket), at most 512."""
    top = min(max_num_seqs, MAX_BUCKET)
    buckets = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
    return [*buckets, top]


def is_pure_decode(chunks: Sequence[SequenceChunk]) -> bool:
    return bool(chunks) and all(
        c.num_new_tokens == 1 and c.sample and c.num_draft == 0 for c in chunks
    )


class DecodeGraphs:
    """Runs pure-decode steps of up to `buckets[-1]` sequences at fixed shapes."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.block_size = block_size
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        size = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        pinned = device.type == "cuda"
        # rows: input_ids, positions, slot_mapping, context_lens
        self._host = torch.zeros(4, size, dtype=torch.long, pin_memory=pinned)
        self._host_tables = torch.zeros(size, self.max_blocks, dtype=torch.long, pin_memory=pinned)
        self._buffers = torch.zeros(4, size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self._buffers
        # Recorded after each step's copies; the next step waits for it before it rewrites
        # the pinned host buffers (the sampler's sync has nearly always passed it already).
        self._copied = torch.cuda.Event() if pinned else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's hidden states

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, chunks: Sequence[SequenceChunk]) -> bool:
        return (
            len(chunks) <= self.max_batch
            and is_pure_decode(chunks)
            and all(len(c.block_table) <= self.max_blocks for c in chunks)
        )

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Final hidden states [len(chunks), hidden_size] of a pure-decode step, in chunk order."""
        num_seqs = len(chunks)
        bucket = self.bucket(num_seqs)
        self._stage(chunks, bucket)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return self.outputs[bucket][:num_seqs]
        return self._forward(bucket, bucket - num_seqs)[:num_seqs]

    def _stage(self, chunks: Sequence[SequenceChunk], bucket: int) -> None:
        """Fill the host buffers for `bucket` rows and copy them to the device (non-blocking)."""
        num_seqs = len(chunks)
        host = self._host
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        positions = [c.start_pos for c in chunks]
        lens = [len(c.block_table) for c in chunks]
        width = max(lens)
        tables = np.zeros((num_seqs, width), dtype=np.int64)
        flat = np.fromiter(
            itertools.chain.from_iterable(c.block_table for c in chunks), np.int64, sum(lens)
        )
        rows = np.repeat(np.arange(num_seqs), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        tables[rows, cols] = flat
        pos = torch.tensor(positions, dtype=torch.long)
        table_rows = torch.from_numpy(tables)
        host[0, :num_seqs] = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long)
        host[1, :num_seqs] = pos
        block_of = table_rows.gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1)
        host[2, :num_seqs] = block_of * self.block_size + pos % self.block_size
        host[3, :num_seqs] = pos + 1
        host[:, num_seqs:bucket] = 0
        host[2, num_seqs:bucket] = -1  # padding: no KV write
        self._host_tables[:num_seqs, :width] = table_rows
        # Contiguous sources only: a strided one would be copied to pageable memory first.
        # Whole rows of the tables go; entries past a row's own blocks are never read.
        self._buffers.copy_(host, non_blocking=True)
        self.block_tables[:num_seqs].copy_(self._host_tables[:num_seqs], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _metadata(self, bucket: int, num_padding: int) -> AttentionMetadata:
        empty = torch.zeros(1, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket],
            prefills=[],
            block_size=self.block_size,
            prefill_query_start_loc=empty,
            prefill_context_start_loc=empty,
            prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=self.device),
            num_padding=num_padding,
        )

    def _forward(self, bucket: int, num_padding: int) -> torch.Tensor:
        metadata = self._metadata(bucket, num_padding)
        with self.backend.step_context():
            hidden: torch.Tensor = self.model(
                self.input_ids[:bucket], self.positions[:bucket], metadata
            )
        return hidden

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one CUDA graph per bucket, largest first, sharing one memory pool."""
        if not self.backend.handles_padding:
            raise ValueError(f"the {self.backend.name} back end cannot run under a CUDA graph")
        self._host[:, :] = 0
        self._host[2] = -1  # every row padding while capturing: nothing is written
        self._buffers.copy_(self._host)
        pool = None
        for bucket in reversed(self.buckets):
            self._forward(bucket, 0)  # warm-up: Triton compiles here, not while capturing
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket, 0)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
