"""`/v1/completions` with a batch of prompts (strings or token-id lists), through a real router
and engine worker: one choice per prompt and n, numbered as OpenAI numbers them, each equal to
the same prompt's answer alone; usage summed; streamed or whole; the batch's size bounded."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from deploy.runtime.handle import LocalHandle
from engine.config import EngineConfig
from router.config import RouterConfig
from tests.router.harness import RouterThread
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

PROMPTS = ["The quick brown fox", "Le café est", "A router streams tokens to many"]
MAX_PROMPTS = 4


@pytest.fixture(scope="module")
def client(tiny_model_dir: str) -> Iterator[openai.OpenAI]:
    engine_config = EngineConfig(model_dir=tiny_model_dir, dtype="float64", block_size=8)
    config = RouterConfig(
        model_dir=tiny_model_dir,
        http_port=0,
        load_refresh_interval_s=0.02,
        max_prompts_per_request=MAX_PROMPTS,
    )

    def make_handles():
        worker = Worker(WorkerConfig(engine_config), "colocated-0")
        return [LocalHandle("colocated-0", Role.COLOCATED, worker)], []

    with RouterThread(config, make_handles) as server:
        assert server.router is not None
        base_url = f"http://127.0.0.1:{server.router.http_port}/v1"
        yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny_model_dir: str) -> str:
    return RouterConfig(model_dir=tiny_model_dir).model_name


def _alone(client: openai.OpenAI, model: str, prompt, **fields):
    return client.completions.create(model=model, prompt=prompt, temperature=0, **fields)


def test_a_batch_answers_each_prompt_as_alone_numbered_and_summed(client, model) -> None:
    alone = [_alone(client, model, p, max_tokens=6) for p in PROMPTS]
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(2 * len(PROMPTS)))
    for choice in out.choices:
        assert choice.text == alone[choice.index // 2].choices[0].text
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_token_id_batches_score_the_echoed_prompt_as_alone(client, model) -> None:
    # lm-eval's loglikelihood requests: echo the prompt, score every token, one new token
    batch = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 8]]
    fields = {"max_tokens": 1, "echo": True, "logprobs": 1}
    alone = [_alone(client, model, ids, **fields).choices[0] for ids in batch]
    out = client.completions.create(model=model, prompt=batch, temperature=0, **fields)
    for got, want in zip(out.choices, alone, strict=True):
        assert got.text == want.text
        # float64; a batched step may round the last bit differently
        assert got.logprobs.token_logprobs[0] is None is want.logprobs.token_logprobs[0]
        assert got.logprobs.token_logprobs[1:] == pytest.approx(
            want.logprobs.token_logprobs[1:], abs=1e-9
        )
        assert got.logprobs.tokens == want.logprobs.tokens


def test_a_streamed_batch_interleaves_numbered_choices(client, model) -> None:
    alone = [_alone(client, model, p, max_tokens=6).choices[0].text for p in PROMPTS]
    texts: dict[int, str] = {}
    ids = set()
    finished = 0
    for chunk in client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True
    ):
        ids.add(chunk.id)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finished += choice.finish_reason is not None
    assert [texts[i] for i in range(len(PROMPTS))] == alone
    assert finished == len(PROMPTS) and len(ids) == 1
    whole = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPTS,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert not chunks[-1].choices and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_batch_over_the_limit_or_with_a_bad_prompt_gets_a_400(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=["a"] * (MAX_PROMPTS + 1), max_tokens=1)
    assert caught.value.body["param"] == "prompt" and "max_prompts_per_request" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=["fine", ""], max_tokens=1)
    assert caught.value.body["param"] == "prompt"
