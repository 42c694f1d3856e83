"""Linear layers on CPU through oneDNN, with each weight reordered once, at load, into its layout.

`F.linear` on CPU is MKL's sgemm, which re-reads the row-major weight for every call and runs
its small-M shapes poorly: on the 2-core AMD EPYC (AVX2) development machine, one thread,
SmolLM2-135M's gate/up projection (3072 x 576) took 1.13 ms at 4 rows against 0.35 ms at one, and
its 49,152-row LM head 28.5 ms at 4 rows against 9.2 at one. A decode step of 4-8 sequences paid
that in all 121 of its matmuls: 154 ms at 4 sequences against 70 ms at one. oneDNN's inner
product over a weight reordered for it (`torch.ops.mkldnn._reorder_linear_weight`, what
torch.compile's CPU back end and vLLM's CPU build use) ran the same shapes in 0.65 and 11 ms;
a prefill of 256 tokens, already at MKL's peak of about 40 GFLOP/s, gains 5-10%.

`pack_linears(model)` reorders the weight of every tensor-parallel linear layer and the LM head
(engine/parallel.py) where `can_pack` holds: a CPU tensor in float32, or bfloat16 where oneDNN
runs it natively. The reordered copy replaces the weight, so weights take no more memory, except
an LM head tied to the embedding, which keeps the embedding's table for the lookup. Results are
float32 sums in another order than MKL's: within float32 rounding of F.linear, not bitwise.
float64 (the parity tests) and CUDA keep F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The row count the reorder is tuned for. Any count runs; 16 ran as fast as 256 at prefill
# sizes and as 8 at decode sizes, where 1 was 2x slower at 4-8 rows.
PACK_ROWS_HINT = 16


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN takes this weight: a 2-D CPU tensor in float32 (or native bfloat16)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for oneDNN's inner product (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    """x W^T + b, through the packed weight where the layer has one."""
    if packed is None:
        assert weight is not None
        return F.linear(x, weight, bias)
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
    )
    return flat.view(*x.shape[:-1], flat.shape[-1])


def pack_linears(model: nn.Module) -> int:
    """Reorder every packable linear layer's weight; the number of layers packed.

    A layer opts in by having `packed_weight` (engine/parallel.py's linear layers and LM head).
    Its `weight` parameter is dropped afterwards unless another module shares it (a tied LM
    head), so the loader must have run first.
    """
    shared = _shared_parameters(model)
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed_weight") or weight is None or not can_pack(weight):
            continue
        module.packed_weight = pack_weight(weight)
        if id(weight) not in shared:
            module.register_parameter("weight", None)
        count += 1
    return count


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters that more than one module holds."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return {key for key, count in holders.items() if count > 1}
