"""Mixtral: the Mistral block with a sparse mixture-of-experts MLP on every layer.

The checkpoint names the MoE block `block_sparse_moe` and each expert's projections w1 (gate),
w3 (up) and w2 (down); they load into engine.models.moe's fused expert weights (gate of expert
e: shard 2e of `w13`, up: 2e + 1; down: shard e of `w2`).
"""

from __future__ import annotations

import re

from engine.models.llama import LlamaForCausalLM

# layers.N.block_sparse_moe.(gate | experts.E.(w1|w2|w3)).weight
_MOE = re.compile(r"^(layers\.\d+)\.block_sparse_moe\.(?:gate|experts\.(\d+)\.(w1|w2|w3))\.weight$")


class MixtralForCausalLM(LlamaForCausalLM):
    def checkpoint_param(self, checkpoint_name: str) -> tuple[str, int] | None:
        match = _MOE.match(checkpoint_name.removeprefix("model."))
        if match is None:
            return super().checkpoint_param(checkpoint_name)
        layer, expert, projection = match.group(1), match.group(2), match.group(3)
        if expert is None:
            return f"{layer}.mlp.gate.weight", 0
        if projection == "w2":
            return f"{layer}.mlp.w2", int(expert)
        return f"{layer}.mlp.w13", 2 * int(expert) + (projection == "w3")
