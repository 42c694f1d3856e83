"""Linear layers over oneDNN-packed weights (engine/cpu_linear.py): the same products as F.linear
within float32 rounding, the model's weights replaced rather than copied, and a packed float32
model scoring prompts as the unpacked one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.cpu_linear import can_pack, linear, pack_weight
from engine.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from tests.tiny_models import FAMILIES

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (300, 64), (2, 3, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(*shape, generator=gen)
    got = linear(x, None, bias, pack_weight(weight))
    assert got.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_only_cpu_float32_weights_pack() -> None:
    assert can_pack(torch.zeros(4, 4))
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float64))
    assert not can_pack(torch.zeros(4))


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params)
    return [
        [entry.logprob for entry in out.prompt_logprobs if entry is not None] for out in outputs
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_model_scores_prompts_as_unpacked(tiny_model, family: str) -> None:
    """Every family's linear layers pack in float32; weights are dropped where nothing else
    holds them (a tied LM head keeps the embedding's), and prompt log-probabilities agree."""
    model_dir = tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (7, 33)]
    kwargs = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 64, "seed": 0}
    packed = LLM(model_dir, **kwargs)
    plain = LLM(model_dir, packed_linears=False, **kwargs)
    model = packed.engine.executor._runner.model
    layers = [
        m
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)
    ]
    assert layers and all(m.packed_weight is not None for m in layers)
    embedding = model.embed_tokens.weight
    for m in layers:
        assert m.weight is None or m.weight is embedding  # replaced, not copied
    got, want = _prompt_logprobs(packed, prompts), _prompt_logprobs(plain, prompts)
    for row_got, row_want in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(row_got), torch.tensor(row_want), atol=1e-4, rtol=0)
