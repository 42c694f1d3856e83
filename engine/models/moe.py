"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral), its experts split across TP ranks as vLLM does.

Routing is transformers' exactly: router logits in the model dtype, softmax in float32, top-k
of the probabilities, optionally renormalised over the k chosen (`norm_topk_prob`), then cast
back to the model dtype (Qwen3-MoE) or kept in float32 (Mixtral).

Tensor parallelism without expert parallelism: every rank holds every expert, each expert's
intermediate dim split across ranks (gate/up by rows, down by columns, as a dense MLP is). A
rank's sum over its experts is a partial sum of the block's output; one all-reduce per block
completes it. The router weight is replicated.

Experts run as a batched loop: the (token, expert) pairs are sorted by expert once, and each
expert hit multiplies its contiguous run of tokens with two matmuls; in the dtypes torch's
grouped matmul takes (all but float64), all experts run in two grouped matmuls instead, with
no wait for the host (a CUDA graph captures them); the float64 loop reads the counts on the host.

Weights: `w13` [num_experts, 2 * local_intermediate, hidden] (gate rows, then up rows) and
`w2` [num_experts, hidden, local_intermediate]. The checkpoint keeps one tensor per expert and
projection; each is a shard of ours (gate of expert e: shard 2e, up: 2e + 1; down: shard e).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.parallel import _copy, divide, tp_all_reduce, tp_rank, tp_size


def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch's grouped matmul takes float32, bfloat16 and float16 (not float64)."""
    return hasattr(F, "grouped_mm") and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_float32 = config.moe_weights_float32
        self.local_size = divide(config.moe_intermediate_size, tp_size(), "moe_intermediate_size")
        hidden, local = config.hidden_size, self.local_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(
            torch.empty(self.num_experts, 2 * local, hidden), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, local), requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w13.num_shards = 2 * self.num_experts  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.w2.num_shards = self.num_experts  # type: ignore[attr-defined]

    def _load_w13(self, param: torch.Tensor, loaded: Any, shard_id: int) -> None:
        expert, part = divmod(shard_id, 2)  # part 0: gate_proj, 1: up_proj
        start = tp_rank() * self.local_size
        rows = param[expert].narrow(0, part * self.local_size, self.local_size)
        _copy(rows, loaded[start : start + self.local_size])

    def _load_w2(self, param: torch.Tensor, loaded: Any, shard_id: int) -> None:
        start = tp_rank() * self.local_size
        _copy(param[shard_id], loaded[:, start : start + self.local_size])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k], expert ids [tokens, top_k]), as transformers: the weights in
        x's dtype, or in float32 where the model keeps them so (Mixtral)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_float32 else weights.to(logits.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # (token, k) pairs grouped by expert
        token_ids = order // self.top_k
        # A scatter-add into a fixed-size tensor: bincount waits for the host on CUDA (it
        # sizes its output by the largest id), which no CUDA graph can capture.
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        routed = x.index_select(0, token_ids)
        if grouped_mm_available(x):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            gate_up = F.grouped_mm(routed, self.w13.transpose(1, 2), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            out = F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offsets)
        else:
            out = torch.empty_like(routed)
            start = 0
            for expert, count in enumerate(counts.tolist()):
                if count:
                    rows = slice(start, start + count)
                    gate, up = F.linear(routed[rows], self.w13[expert]).chunk(2, dim=-1)
                    out[rows] = F.linear(F.silu(gate) * up, self.w2[expert])
                    start += count
        scaled = out * weights.reshape(-1, 1)[order]  # float32 for Mixtral, then cast back
        out = scaled.to(x.dtype)
        result = torch.zeros_like(x).index_add_(0, token_ids, out)
        return tp_all_reduce(result)
