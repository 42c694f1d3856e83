"""Attention metadata: everything the attention layers need about one step, built once per step.

Token order inside a step (the model runner guarantees it):

    [ decode tokens (one per decode chunk) | prefill chunk 0 tokens | prefill chunk 1 tokens | ... ]

so decode attention reads one contiguous slice of q and writes one contiguous slice of the output.
A "prefill chunk" is any chunk with more than one token, or a first chunk (start_pos == 0) of one
token; it may start after already-cached positions (chunked prefill, prefix cache hits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefillChunkInfo:
    token_start: int  # first index of this chunk's tokens in the step's packed tokens
    num_tokens: int
    start_pos: int  # positions [0, start_pos) are already in the cache
    context_len: int  # start_pos + num_tokens
    block_table: torch.Tensor  # [num_blocks_needed] long, enough for context_len tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: flat KV slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] long, including the new token
    prefills: list[PrefillChunkInfo]
    block_size: int
    # For varlen kernels (flash): the prefill part only, as int32.
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] cumulative query lengths
    prefill_context_start_loc: torch.Tensor  # [num_prefills + 1] cumulative context lengths
    prefill_block_tables: torch.Tensor  # [num_prefills, max_prefill_blocks] padded with 0
    # A fixed-shape step (engine/graphs.py) pads its decode rows to a batch-size bucket: the last
    # num_padding rows are padding, with slot -1 and context length 0 (no KV write, zero output).
    num_padding: int = 0
    # Masks (and the torch backend's decode groups) cached per sliding window (None = full
    # attention), filled by the backend on first use so every layer of the step shares them.
    mask_cache: dict[object, Any] = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def max_decode_context_len(self) -> int:
        return self.decode_block_tables.shape[1] * self.block_size

    def without_padding(self) -> AttentionMetadata:
        """The metadata of the real rows alone (padding is only ever in a pure-decode step)."""
        real = self.num_decode_tokens - self.num_padding
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping[:real],
            num_decode_tokens=real,
            decode_block_tables=self.decode_block_tables[:real],
            decode_context_lens=self.decode_context_lens[:real],
            num_padding=0,
            mask_cache={},
        )

    @property
    def max_prefill_query_len(self) -> int:
        return max((p.num_tokens for p in self.prefills), default=0)

    @property
    def max_prefill_context_len(self) -> int:
        return max((p.context_len for p in self.prefills), default=0)


def pad_block_tables(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(block_tables), longest] long tensor, short rows padded with block 0 (masked out)."""
    width = max((len(t) for t in block_tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.long, device=device).view(len(block_tables), width)


def build_attention_metadata(
    start_positions: list[int],
    num_new_tokens: list[int],
    block_tables: list[list[int]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and the positions tensor for chunks given in step order (decodes first).

    Per chunk: start_pos, number of new tokens, block table. Returns (metadata, positions) with
    positions [num_tokens] long. Vectorised over tokens: no per-token Python.
    """
    num_chunks = len(start_positions)
    lens = torch.tensor(num_new_tokens, dtype=torch.long)
    starts = torch.tensor(start_positions, dtype=torch.long)
    token_starts = torch.cumsum(lens, 0) - lens
    chunk_of_token = torch.repeat_interleave(torch.arange(num_chunks), lens)
    token_index = torch.arange(int(lens.sum()))
    positions = starts[chunk_of_token] + token_index - token_starts[chunk_of_token]
    tables = pad_block_tables(block_tables, torch.device("cpu"))
    slot_mapping = (
        tables[chunk_of_token, positions // block_size] * block_size + positions % block_size
    )

    prefills = [
        PrefillChunkInfo(
            token_start=int(token_starts[i]),
            num_tokens=num_new_tokens[i],
            start_pos=start_positions[i],
            context_len=start_positions[i] + num_new_tokens[i],
            block_table=to_device(torch.tensor(block_tables[i], dtype=torch.long), device),
        )
        for i in range(num_decodes, num_chunks)
    ]
    context_lens = starts + lens
    decode_blocks = -(-int(context_lens[:num_decodes].max()) // block_size) if num_decodes else 0
    prefill_q = torch.zeros(num_chunks - num_decodes + 1, dtype=torch.int32)
    prefill_q[1:] = torch.cumsum(lens[num_decodes:], 0)
    prefill_k = torch.zeros_like(prefill_q)
    prefill_k[1:] = torch.cumsum(context_lens[num_decodes:], 0)
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        num_decode_tokens=num_decodes,
        decode_block_tables=to_device(tables[:num_decodes, :decode_blocks], device),
        decode_context_lens=to_device(context_lens[:num_decodes], device),
        prefills=prefills,
        block_size=block_size,
        prefill_query_start_loc=to_device(prefill_q, device),
        prefill_context_start_loc=to_device(prefill_k, device),
        prefill_block_tables=to_device(tables[num_decodes:].to(torch.int32), device),
    )
    return metadata, to_device(positions, device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory and a non-blocking copy, which
    does not wait for the GPU to finish its queued work as a pageable copy does."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
