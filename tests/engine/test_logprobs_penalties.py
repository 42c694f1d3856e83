"""Log-probabilities and logits processors against transformers, in float64 on tiny models.

The processors (logit_bias, min_tokens, repetition penalty) are checked against transformers' own
logits processors in a greedy loop over the HF model; the frequency and presence penalties,
which transformers does not have, against OpenAI's formula applied to HF's logits. Log-
probabilities (sampled tokens with their top-k, and the prompt's, through chunked prefill and
past a prefix cache that holds the prompt) equal log-softmax of HF's logits of the full sequence.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine import LLM, SamplingParams
from tests.engine.test_llm import make_prompts
from tests.tiny_models import load_hf_model

ENGINE_KWARGS = {"dtype": "float64", "block_size": 8, "num_kv_blocks": 128}
EOS = 2  # tests/tiny_models.py
PROMPTS = make_prompts((5, 19, 33))


def hf_processed_greedy(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding over HF logits with transformers' processors, in vLLM's order."""
    hf = load_hf_model(model_dir, torch.float64)
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, EOS))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids = torch.tensor([prompt])
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            scores = processors(ids, hf(ids).logits[:, -1, :].clone())
            if output:  # OpenAI's penalties, over the output tokens only
                counts = torch.bincount(torch.tensor(output), minlength=scores.shape[-1])
                scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
            token = int(scores.argmax())
            output.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token == EOS:
                break
    return output


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=24, repetition_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=24, presence_penalty=-1.0, ignore_eos=True),
        # EOS biased to win: min_tokens holds it off for exactly 7 tokens
        SamplingParams(max_tokens=24, min_tokens=7, logit_bias={EOS: 100.0, 11: 5.0}),
        SamplingParams(
            max_tokens=24, logit_bias={7: 3.0, 99: -2.0}, repetition_penalty=1.3, ignore_eos=True
        ),
    ],
)
def test_processors_equal_transformers(tiny_model, params: SamplingParams) -> None:
    model_dir = tiny_model("llama")
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        outputs = llm.generate(PROMPTS, params)
    plain = [hf_processed_greedy(model_dir, p, SamplingParams(max_tokens=24)) for p in PROMPTS]
    expected = [hf_processed_greedy(model_dir, prompt, params) for prompt in PROMPTS]
    assert [out.token_ids for out in outputs] == expected
    assert expected != plain  # the processors changed something
    if params.min_tokens:
        assert all(len(e) == params.min_tokens + 1 and e[-1] == EOS for e in expected)


def test_a_moved_request_still_counts_its_sent_tokens_in_the_penalties(tiny_model) -> None:
    """A migration sends the prompt plus the tokens already streamed (router/recovery.py); with
    prior_output_tokens the penalties still count those as output, so the rest of the stream is
    the undisturbed one's. Without it they would forget them, and the stream would change."""
    model_dir = tiny_model("llama")
    params = SamplingParams(max_tokens=32, frequency_penalty=2.0, ignore_eos=True)
    sent = 12
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        whole = [out.token_ids for out in llm.generate(PROMPTS, params)]
        prompts = [p + w[:sent] for p, w in zip(PROMPTS, whole, strict=True)]
        rest = params.max_tokens - sent
        moved = llm.generate(prompts, replace(params, max_tokens=rest, prior_output_tokens=sent))
        forgetful = llm.generate(prompts, replace(params, max_tokens=rest))
    assert [out.token_ids for out in moved] == [w[sent:] for w in whole]
    assert [out.token_ids for out in forgetful] != [w[sent:] for w in whole]


def _hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits over the whole sequence: row t scores token t + 1."""
    hf = load_hf_model(model_dir, torch.float64)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0], dim=-1)


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_logprobs_and_prompt_logprobs_equal_log_softmax(tiny_model, chunk_size) -> None:
    model_dir = tiny_model("llama")
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    kwargs = dict(ENGINE_KWARGS, enable_prefix_caching=True)
    if chunk_size is not None:
        kwargs.update(chunk_size=chunk_size, max_num_batched_tokens=16)
    with LLM(model_dir, **kwargs) as llm:
        llm.generate(PROMPTS, SamplingParams(max_tokens=2))  # the prompts now sit in the cache
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.num_cached_tokens == 0  # prompt logprobs need every prompt token's logits
        reference = _hf_logprobs(model_dir, prompt + out.token_ids)
        assert out.token_ids == reference[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert out.logprobs is not None
        entries = [*out.prompt_logprobs[1:], *out.logprobs]
        assert len(entries) == len(prompt) - 1 + len(out.token_ids)
        for position, entry in enumerate(entries, start=1):
            assert entry is not None
            row = reference[position - 1]
            token = (prompt + out.token_ids)[position]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-9)
            assert entry.rank == int((row > row[token]).sum()) + 1
            num_top = 3 if position < len(prompt) else 4
            top_values, top_ids = row.topk(num_top)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-9)


def test_logprobs_zero_gives_the_sampled_token_only(tiny_model) -> None:
    model_dir = tiny_model("llama")
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, logprobs=0)
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        (out,) = llm.generate(PROMPTS[:1], params)
    assert out.logprobs is not None and out.prompt_logprobs is None
    reference = _hf_logprobs(model_dir, PROMPTS[0] + out.token_ids)
    for i, entry in enumerate(out.logprobs):
        assert entry.top == []
        token = out.token_ids[i]
        row = reference[len(PROMPTS[0]) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-9)


def test_sampling_params_refuse_bad_values() -> None:
    for bad in (
        {"logprobs": -1},
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0.0},
        {"min_tokens": 20, "max_tokens": 10},
        {"logit_bias": {3: 101.0}},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_processors_and_logprobs_beside_speculating_requests(tiny_model) -> None:
    """Under speculation, a request with processors or logprobs proposes nothing, but it shares
    verification steps with requests that do: its tokens and logprobs stay the plain engine's."""
    from engine.speculative.config import SpeculativeConfig

    model_dir = tiny_model("llama")
    repeat = [5, 6, 7, 8, 9] * 8  # prompt lookup proposes on this one
    prompts = [repeat, PROMPTS[1], repeat]
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.5, logprobs=2),
        SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=1.0, logit_bias={5: 2.0}),
    ]
    spec = SpeculativeConfig(num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    with LLM(model_dir, speculative=spec, **ENGINE_KWARGS) as llm:
        speculated = llm.generate(prompts, params)
        assert llm.stats.num_spec_proposed > 0
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        plain = llm.generate(prompts, params)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert speculated[1].logprobs is not None and plain[1].logprobs is not None
    for ours, theirs in zip(speculated[1].logprobs, plain[1].logprobs, strict=True):
        # batch shapes differ between the two runs: equal to float64 rounding
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-12)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
    assert speculated[1].token_ids == hf_processed_greedy(model_dir, prompts[1], params[1])
