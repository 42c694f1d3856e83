"""Phi-3: the Llama block with q/k/v and gate/up already fused in the checkpoint.

`self_attn.qkv_proj` holds q, k and v stacked by rows ([(heads + 2 * kv_heads) * head_dim,
hidden]) and `mlp.gate_up_proj` gate then up ([2 * intermediate, hidden]). Our fused parameters
have the same names, but each TP rank holds its own slice of every part, so each part is loaded
as a shard of its own, read from its first row in the checkpoint tensor.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_targets(self, checkpoint_name: str) -> list[tuple[str, int, int]]:
        cfg = self.config
        name = checkpoint_name.removeprefix("model.")
        if ".self_attn.qkv_proj." in name:
            q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(name, 0, 0), (name, 1, q_rows), (name, 2, q_rows + kv_rows)]
        if ".mlp.gate_up_proj." in name:
            return [(name, 0, 0), (name, 1, cfg.intermediate_size)]
        return super().checkpoint_targets(checkpoint_name)
