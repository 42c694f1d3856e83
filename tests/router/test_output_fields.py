"""Log-probabilities, echo, n and the logits processors through both front doors: the `openai`
SDK over HTTP and gRPC, against a real tiny model (float64) served on 127.0.0.1. Every number is
checked against transformers: log-softmax of its logits, and its own logits processors.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import openai
import pytest
import torch
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc

from deploy.runtime.handle import LocalHandle
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.recovery import continuation
from router.tokenizer import RouterTokenizer
from router.validation import ValidatedRequest
from tests.engine.test_logprobs_penalties import hf_processed_greedy
from tests.router.harness import RouterThread
from tests.tiny_models import load_hf_model
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

BLOCK_SIZE = 8
PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RouterThread]:
    engine_config = EngineConfig(
        model_dir=tiny_model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=96
    )
    config = RouterConfig(model_dir=tiny_model_dir, http_port=0, load_refresh_interval_s=0.02)

    def make_handles():
        worker = Worker(WorkerConfig(engine_config), "colocated-0")
        return [LocalHandle("colocated-0", Role.COLOCATED, worker)], []

    with RouterThread(config, make_handles) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RouterThread) -> openai.OpenAI:
    assert server.router is not None
    base_url = f"http://127.0.0.1:{server.router.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def stub(server: RouterThread) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir: str):
    hf = load_hf_model(tiny_model_dir, torch.float64)

    def run(token_ids: list[int]) -> torch.Tensor:
        """Row t: log-probabilities of the token after position t."""
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0], dim=-1)

    return run


def test_completions_echo_with_logprobs_scores_the_prompt(
    client, model, tokenizer: RouterTokenizer, hf_logprobs
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    all_ids = _greedy(hf_logprobs, prompt_ids, 3)
    reference = hf_logprobs(all_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.token_logprobs) == len(prompt_ids) + 3
    for position in range(1, len(all_ids)):
        expected = float(reference[position - 1, all_ids[position]])
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-9), position
        top = logprobs.top_logprobs[position]
        best = reference[position - 1].topk(2)
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-9)
    # greedy: each generated token is the most likely one
    for position in range(len(prompt_ids), len(all_ids)):
        assert logprobs.token_logprobs[position] == max(logprobs.top_logprobs[position].values())
    streamed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed_logprobs = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed_logprobs == logprobs.token_logprobs


def _greedy(hf_logprobs, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The prompt and HF's greedy continuation."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        ids.append(int(hf_logprobs(ids)[-1].argmax()))
    return ids


def test_grpc_logprobs_and_prompt_logprobs_equal_log_softmax(stub, hf_logprobs) -> None:
    request = pb.GenerateRequest(
        token_ids=list(range(5, 30)), max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    responses = list(stub.Generate(request, timeout=30))
    assert responses[0].prompt_logprobs and list(responses[0].prompt_token_ids) == list(
        range(5, 30)
    )
    prompt_entries = list(responses[0].prompt_logprobs)
    assert prompt_entries[0].rank == 0 and not prompt_entries[0].top
    generated = [t for r in responses for t in r.token_ids]
    entries = prompt_entries[1:] + [e for r in responses for e in r.logprobs]
    all_ids = list(range(5, 30)) + generated
    reference = hf_logprobs(all_ids)
    assert len(entries) == len(all_ids) - 1
    for position, entry in enumerate(entries, start=1):
        row = reference[position - 1]
        assert entry.token_id == all_ids[position]
        assert entry.logprob == pytest.approx(float(row[all_ids[position]]), abs=1e-9)
        assert entry.rank == int((row > row[all_ids[position]]).sum()) + 1
        num_top = 2 if position < 25 else 3
        assert [t.token_id for t in entry.top] == row.topk(num_top).indices.tolist()
    unary = stub.GenerateUnary(request, timeout=30)
    assert list(unary.token_ids) == generated
    assert [e.logprob for e in unary.logprobs] == [e.logprob for r in responses for e in r.logprobs]
    assert len(unary.prompt_logprobs) == 25
    # one token: the chunk that carries the prompt's logprobs is also the one that finishes
    one_token = pb.GenerateRequest()
    one_token.CopyFrom(request)
    one_token.max_tokens = 1
    single = stub.GenerateUnary(one_token, timeout=30)
    assert [e.token_id for e in single.prompt_logprobs] == [e.token_id for e in prompt_entries]
    assert list(single.token_ids) == generated[:1] and len(single.logprobs) == 1


def test_chat_logprobs_and_top_logprobs(client, model, tokenizer, hf_logprobs) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == out.usage.completion_tokens == 4
    prompt_ids = tokenizer.encode_chat([("user", "Name three colours.")])
    generated = _greedy(hf_logprobs, prompt_ids, 4)[len(prompt_ids) :]
    reference = hf_logprobs(prompt_ids + generated)
    for i, entry in enumerate(content):
        row = reference[len(prompt_ids) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[generated[i]]), abs=1e-9)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-9
        )
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed_entries = [
        e.logprob for c in streamed for ch in c.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert streamed_entries == [e.logprob for e in content]


def test_vllm_prompt_logprobs_field(client, model, tokenizer, hf_logprobs) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = out.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = tokenizer.encode(PROMPT)
    reference = hf_logprobs(prompt_ids)
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        entry = entries[position][str(prompt_ids[position])]
        assert entry["logprob"] == pytest.approx(
            float(reference[position - 1, prompt_ids[position]]), abs=1e-9
        )


@pytest.mark.parametrize(
    ("fields", "params"),
    [
        (
            {"frequency_penalty": 1.5, "presence_penalty": 0.5},
            SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5),
        ),
        (
            {"logit_bias": {"7": 3.0, "99": -2.0}, "extra_body": {"repetition_penalty": 1.3}},
            SamplingParams(max_tokens=12, logit_bias={7: 3.0, 99: -2.0}, repetition_penalty=1.3),
        ),
        (
            {"logit_bias": {"2": 100.0}, "extra_body": {"min_tokens": 5}},
            SamplingParams(max_tokens=12, logit_bias={2: 100.0}, min_tokens=5),
        ),
    ],
)
def test_processors_through_sdk_and_grpc_equal_transformers(
    client, stub, model, tiny_model_dir, tokenizer, fields, params
) -> None:
    prompt_ids = list(range(40, 61))
    expected = hf_processed_greedy(tiny_model_dir, prompt_ids, params)
    body = dict(fields)
    extra = body.pop("extra_body", {})
    out = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=12, temperature=0, extra_body=extra, **body
    )
    assert out.choices[0].text == tokenizer.decode(expected)
    request = pb.GenerateRequest(
        token_ids=prompt_ids,
        max_tokens=12,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
    )
    assert list(stub.GenerateUnary(request, timeout=30).token_ids) == expected


def test_n_completions_share_the_prompt_through_the_prefix_cache(client, model, stub) -> None:
    prompt_ids = list(range(100, 141))  # 41 tokens: 5 full blocks of 8 cached
    request = pb.GenerateRequest(
        token_ids=prompt_ids, max_tokens=6, n=3, temperature=1.0, seed=11, ignore_eos=True
    )
    responses = list(stub.Generate(request, timeout=30))
    by_index: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    for response in responses:
        by_index.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            cached[response.index] = response.usage.cached_prompt_tokens
    assert sorted(by_index) == [0, 1, 2] and all(len(t) == 6 for t in by_index.values())
    assert len({tuple(t) for t in by_index.values()}) > 1  # seeds seed, seed + 1, seed + 2
    assert cached[1] == cached[2] == 40  # the siblings computed only the last block
    for index in (1, 2):  # each sibling reproduces as a request of its own seed
        alone = pb.GenerateRequest(
            token_ids=prompt_ids, max_tokens=6, temperature=1.0, seed=11 + index, ignore_eos=True
        )
        assert list(stub.GenerateUnary(alone, timeout=30).token_ids) == by_index[index]
    out = client.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [
        client.completions.create(
            model=model,
            prompt=prompt_ids,
            max_tokens=6,
            temperature=1.0,
            seed=11 + i,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for i in range(3)
    ]
    assert out.usage.completion_tokens == 18 and out.usage.prompt_tokens == 41
    streamed = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        n=2,
        stream=True,
        seed=3,
    )
    finished = {c.index for chunk in streamed for c in chunk.choices if c.finish_reason}
    assert finished == {0, 1}


def test_a_moved_request_keeps_its_budgets_and_asks_no_prompt_logprobs_again() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=4, prompt_logprobs=2, logprobs=1)
    request = ValidatedRequest("r", [1, 2, 3], params, ())
    moved = continuation(request, [7, 8])
    assert moved.prompt_token_ids == [1, 2, 3, 7, 8]
    assert moved.params.max_tokens == 8 and moved.params.min_tokens == 2
    assert moved.params.prompt_logprobs is None and moved.params.logprobs == 1
    assert continuation(request, []) is request  # a retry before any token asks again


def _stop_inside(text: str, offsets: list[int], token: int) -> str:
    """A stop string that ends inside the text of generated token `token` (offsets: each
    token's start) and occurs nowhere earlier."""
    end = offsets[token] + max(1, (offsets[token + 1] - offsets[token]) // 2)
    for start in range(end - 1, -1, -1):
        if text.find(text[start:end]) == start:
            return text[start:end]
    raise AssertionError("no stop string ends in that token")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_end_where_a_stop_string_cuts_the_text(client, model, stream) -> None:
    prompt_ids = list(range(60, 80))
    body = {"model": model, "prompt": prompt_ids, "temperature": 0, "logprobs": 1}
    full = client.completions.create(
        max_tokens=12, extra_body={"ignore_eos": True}, **body
    ).choices[0]
    offsets = [offset - full.logprobs.text_offset[0] for offset in full.logprobs.text_offset]
    offsets.append(len(full.text))
    token = next(t for t in range(5, 11) if offsets[t + 1] - offsets[t] >= 2)
    stop = _stop_inside(full.text, offsets, token)
    cut = full.text.find(stop)
    out = client.completions.create(max_tokens=12, stop=[stop], n=2, stream=stream, **body)
    choices: dict[int, list] = {}
    for choice in (c for chunk in out for c in chunk.choices) if stream else out.choices:
        choices.setdefault(choice.index, []).append(choice)
    assert sorted(choices) == [0, 1]
    for parts in choices.values():
        assert "".join(p.text for p in parts) == full.text[:cut]
        assert parts[-1].finish_reason == "stop"
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        values = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
        assert tokens == full.logprobs.tokens[: token + 1]  # up to the one the stop ends in
        assert values == pytest.approx(full.logprobs.token_logprobs[: token + 1], abs=1e-9)
    messages = [{"role": "user", "content": "Count."}]
    chat = {"model": model, "messages": messages, "temperature": 0, "logprobs": True}
    full_chat = client.chat.completions.create(
        max_tokens=12, extra_body={"ignore_eos": True}, **chat
    ).choices[0]
    entries = full_chat.logprobs.content
    starts = [0]
    for entry in entries:
        starts.append(starts[-1] + len(bytes(entry.bytes).decode(errors="replace")))
    token = next(t for t in range(5, 11) if starts[t + 1] - starts[t] >= 2)
    stop = _stop_inside(full_chat.message.content, starts, token)
    out = client.chat.completions.create(max_tokens=12, stop=[stop], stream=stream, **chat)
    if stream:
        got = [e for c in out for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    else:
        got = out.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx(
        [e.logprob for e in entries[: token + 1]], abs=1e-9
    )
