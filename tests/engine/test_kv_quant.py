"""The 8-bit KV cache (engine/kv_quant.py): the quantizer's round trip on exact cases and its
error bounds, scale growth and restart within a block, the pool's size for a memory budget, the
prefix cache reusing quantized blocks, and greedy output identical to the unquantized cache on a
model built so its logits are well separated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_quant import KVQuantFormat

BLOCK_SIZE, HEAD_DIM = 4, 8


def cache_for(kind: str, num_heads: int = 2, num_blocks: int = 6) -> tuple[KVQuantFormat, KVCache]:
    spec = KVCacheSpec(1, num_blocks, BLOCK_SIZE, num_heads, HEAD_DIM, torch.float32, kind)
    cache = KVCache(spec)
    assert cache.quant is not None
    return cache.quant, cache


def read_slots(quant: KVQuantFormat, cache: KVCache, slots: list[int]) -> torch.Tensor:
    """The dequantized rows of `slots`: [len(slots), heads, head_dim]."""
    values = quant.dequantize(cache.key(0), torch.float64)  # [heads, blocks, bs, head_dim]
    flat = values.flatten(1, 2)
    return flat[:, slots].transpose(0, 1)


def test_layout_and_sizes() -> None:
    quant, cache = cache_for("int8")
    assert quant.block_bytes == BLOCK_SIZE * HEAD_DIM + 4
    assert cache.data.dtype == torch.uint8
    assert cache.data.shape == (1, 2, 2, 6, quant.block_bytes)
    # 16 x 64 blocks: 4 bytes of scale per 1,024 values
    fp32 = KVCacheSpec.num_blocks_for_budget(1 << 30, 30, 16, 3, 64, torch.float32)
    bf16 = KVCacheSpec.num_blocks_for_budget(1 << 30, 30, 16, 3, 64, torch.bfloat16)
    int8 = KVCacheSpec.num_blocks_for_budget(1 << 30, 30, 16, 3, 64, torch.float32, "int8")
    assert int8 / fp32 >= 3.9 and int8 / bf16 >= 1.95
    with pytest.raises(ValueError, match="not supported"):
        KVCacheSpec(1, 1, 16, 1, 64, torch.float32, "int4")


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_representable_values_round_trip_exactly(kind: str) -> None:
    quant, cache = cache_for(kind)
    qmax = quant.qmax
    # Each head's max |x| is qmax * 2**-3, so the scale is a power of two; the other values
    # are multiples of it that the format holds exactly (integers; e4m3 has 3 mantissa bits).
    grid = [0.0, 1.0, -2.0, 3.0, -12.0, 40.0, 96.0, -qmax]
    x = torch.tensor(grid, dtype=torch.float32).repeat(2, 4)[:, : 4 * HEAD_DIM]
    x = x.view(2, 4, HEAD_DIM).transpose(0, 1) * 2.0**-3  # [4 tokens, 2 heads, head_dim]
    slots = [8, 9, 10, 11]  # one whole block
    quant.write(x, cache.key(0), torch.tensor(slots))
    assert torch.equal(read_slots(quant, cache, slots), x.double())
    assert torch.equal(quant.split(cache.key(0))[1][:, 2], torch.full((2,), 2.0**-3))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_error_bounds_with_a_scale_that_grows(kind: str) -> None:
    """Rows written one at a time, each larger than the last: the block's scale grows, its
    earlier entries are requantized, and every value stays within the format's bound."""
    quant, cache = cache_for(kind, num_heads=1)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, 1, HEAD_DIM, generator=gen) * (1 + 3 * i) for i in range(4)]
    for i, row in enumerate(rows):
        quant.write(row, cache.key(0), torch.tensor([4 + i]))
    x = torch.cat(rows).double()
    got = read_slots(quant, cache, [4, 5, 6, 7])
    scale = float(quant.split(cache.key(0))[1][0, 1])
    exact = float(x.abs().max()) / quant.qmax
    if kind == "int8":
        assert scale == pytest.approx(exact, rel=1e-6)
    else:  # a partly filled block's scale has room (up to 4x) for the rows still to come
        assert exact * (1 - 1e-6) <= scale <= 4 * exact * (1 + 1e-6)
    err = (got - x).abs()
    if kind == "int8":  # half a step per rounding; an entry is rounded at most once per growth
        assert float(err.max()) <= 4 * 0.5 * scale
        assert float(err[3].max()) <= 0.5 * scale * (1 + 1e-6)  # the last row: rounded once
    else:  # 3 mantissa bits: half a step is 2**-4 of the value (subnormals: 2**-10 * scale)
        bound = x.abs() * 2.0**-4 + 2.0**-10 * scale
        assert bool((err[3] <= bound[3] * 1.01).all())
        assert bool((err <= 4 * bound).all())


def test_an_fp8_block_left_partly_filled_has_room_for_larger_rows() -> None:
    quant, cache = cache_for("fp8_e4m3", num_heads=1)
    first = torch.linspace(-1, 1, HEAD_DIM).view(1, 1, HEAD_DIM)
    quant.write(first, cache.key(0), torch.tensor([8]))  # block 2, slot 0: partly filled
    values, scales = quant.split(cache.key(0))
    assert float(scales[0, 2]) == pytest.approx(4 / 448)
    before = values[0, 2, 0].clone()
    quant.write(first * 3, cache.key(0), torch.tensor([9]))  # 3x larger: within the room
    assert float(scales[0, 2]) == pytest.approx(4 / 448)  # no growth, no requantization
    assert torch.equal(values[0, 2, 0], before)
    assert torch.allclose(read_slots(quant, cache, [9]), 3 * first.double(), rtol=2**-4)
    full = torch.full((2, 1, HEAD_DIM), 2.0)  # slots 10 and 11 fill the block: no room kept
    quant.write(full * 10, cache.key(0), torch.tensor([10, 11]))
    assert float(scales[0, 2]) == pytest.approx(20 / 448)


def test_a_block_begun_again_starts_its_scale_afresh() -> None:
    quant, cache = cache_for("int8", num_heads=1)
    big = torch.full((1, 1, HEAD_DIM), 100.0)
    quant.write(big, cache.key(0), torch.tensor([12]))  # block 3, slot 0
    small = torch.linspace(-1, 1, HEAD_DIM).view(1, 1, HEAD_DIM)
    quant.write(small, cache.key(0), torch.tensor([12]))  # the block reused from its start
    assert float(quant.split(cache.key(0))[1][0, 3]) == pytest.approx(1 / 127)
    assert torch.allclose(read_slots(quant, cache, [12]), small.double(), atol=0.5 / 127)


def mode_model(tmp_path: Path) -> str:
    """A one-layer Llama whose next token is the most frequent token of its context.

    Queries are zero, so attention averages the values of every position; each value is its
    token's one-hot row (plus small noise, so 8 bits cannot hold it exactly), the output
    projection puts that average into the second half of the hidden state, and the LM head
    reads only that half. The logits are the context's token counts over its length: a unique
    mode leads by at least 1/length of the value scale, far above 8-bit rounding."""
    vocab = 32
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=2 * vocab,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        embed = torch.zeros(vocab, 2 * vocab)
        embed[:, :vocab] = torch.eye(vocab) * 4 + 0.05 * torch.randn(vocab, vocab, generator=gen)
        model.model.embed_tokens.weight.copy_(embed)
        attn = model.model.layers[0].self_attn
        attn.k_proj.weight.copy_(torch.randn(vocab, 2 * vocab, generator=gen))  # unused: q = 0
        attn.v_proj.weight[:, :vocab] = torch.eye(vocab)
        attn.o_proj.weight[vocab:, :vocab] = torch.eye(vocab)  # head 0's output
        model.lm_head.weight[:, vocab:] = torch.eye(vocab) * 4
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1)
    model.save_pretrained(tmp_path / "mode")
    return str(tmp_path / "mode")


def test_greedy_output_equals_the_unquantized_cache(tmp_path: Path) -> None:
    model_dir = mode_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for mode in (5, 9, 17, 30):  # the mode leads the runner-up by two
        rest = torch.randint(2, 32, (24,), generator=gen).tolist()
        rest = [t for t in rest if t != mode][:16]
        counts = {t: rest.count(t) for t in rest}
        prompts.append([mode] * (max(counts.values()) + 2) + rest)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for kv_dtype in ("auto", "int8", "fp8_e4m3"):
        # chunks of 8 in blocks of 8: later chunks and every decode read the cache back
        with LLM(
            model_dir, dtype="float32", block_size=8, num_kv_blocks=64, chunk_size=8,
            max_num_batched_tokens=16, kv_cache_dtype=kv_dtype,
        ) as llm:  # fmt: skip
            outputs[kv_dtype] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["auto"] == [[p[0]] * 12 for p in prompts]  # the model does what it says
    assert outputs["int8"] == outputs["auto"]
    assert outputs["fp8_e4m3"] == outputs["auto"]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_prefix_cache_reuses_quantized_blocks(tiny_model, kind: str) -> None:
    """A prefix hit reads the quantized blocks as they are: the same greedy tokens as a miss,
    and the pool back to its starting free count."""
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 512, (32,), generator=gen).tolist()
    prompts = [prefix + [7, 8, 9], prefix + [7, 8, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    kwargs = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 64, "kv_cache_dtype": kind}
    with LLM(tiny_model("llama"), **kwargs) as llm:  # type: ignore[arg-type]
        free = llm.engine.block_pool.num_free_blocks
        first = llm.generate(prompts[:1], params)[0]
        second = llm.generate(prompts[1:], params)[0]
        assert second.num_cached_tokens == 32
        assert second.token_ids == first.token_ids
        llm.engine.block_pool.check_integrity()
        assert llm.engine.block_pool.num_free_blocks == free


def test_flash_reads_a_compact_dequantized_copy_of_the_blocks_it_needs() -> None:
    """What the flash-attn back end reads (dequantize_tables): the blocks the tables name,
    dequantized, under renumbered tables that index the same values."""
    quant, cache = cache_for("int8", num_heads=2, num_blocks=6)
    gen = torch.Generator().manual_seed(3)
    slots = torch.arange(24)
    quant.write(torch.randn(24, 2, HEAD_DIM, generator=gen), cache.key(0), slots)
    decode_tables = torch.tensor([[5, 1], [2, 2]], dtype=torch.int32)
    prefill_tables = torch.tensor([[1, 4, 0]])
    dense, (decode_new, prefill_new) = quant.dequantize_tables(
        cache.key(0), [decode_tables, prefill_tables], torch.float32
    )
    assert dense.shape == (2, 5, BLOCK_SIZE, HEAD_DIM)  # blocks 0, 1, 2, 4, 5; 3 unread
    assert decode_new.dtype == torch.int32
    full = quant.dequantize(cache.key(0), torch.float32)
    for old, new in ((decode_tables, decode_new), (prefill_tables, prefill_new)):
        assert torch.equal(dense[:, new.long()], full[:, old.long()])


def test_a_memory_budget_holds_about_four_times_the_blocks(tiny_model) -> None:
    """The pool a worker builds for kv_cache_memory_bytes (serve config: kv_cache.memory_mb)
    counts the 8-bit blocks and their scales; admission and reservations count those blocks."""
    from engine.executor import Executor  # noqa: PLC0415

    blocks = {}
    for kind in ("auto", "int8"):
        config = EngineConfig(
            tiny_model("llama"), kv_cache_memory_bytes=1 << 20, block_size=16, kv_cache_dtype=kind
        )
        executor = Executor(config)
        try:
            blocks[kind] = executor.num_kv_blocks
            assert executor.kv_cache.data.numel() * executor.kv_cache.data.element_size() <= 1 << 20
        finally:
            executor.shutdown()
    assert blocks["int8"] / blocks["auto"] >= 3.8  # head_dim 16 here: a scale per 256 values
