"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture-of-experts MLP on the
layers `ModelConfig.moe_layers` marks (see engine.models.moe), a dense MLP on the others."""

from __future__ import annotations

import re

from engine.models.qwen3 import Qwen3ForCausalLM

# layers.N.mlp.experts.E.(gate_proj|up_proj|down_proj).weight
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def checkpoint_param(self, checkpoint_name: str) -> tuple[str, int] | None:
        match = _EXPERT.match(checkpoint_name.removeprefix("model."))
        if match is None:
            return super().checkpoint_param(checkpoint_name)
        block, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        if projection == "down_proj":
            return f"{block}.w2", expert
        return f"{block}.w13", 2 * expert + (projection == "up_proj")
