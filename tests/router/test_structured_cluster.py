"""Structured output through a served cluster, in each layout: disaggregated at TP 1, at TP 2
(prefill and decode) and with speculation, colocated, and adaptive. The first token is sampled on the prefill instance under the
mask and the decode instance resumes the grammar from it; so outputs validate, the openai SDK's
`parse` helper reads them into a pydantic model, and greedy under a grammar that admits the
model's own answer is that answer, token for token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import openai
import pytest
from pdserve_proto.v1 import generation_pb2 as pb
from pdserve_proto.v1 import generation_pb2_grpc as pb_grpc
from pydantic import BaseModel, Field

from deploy.runtime.local.local_cluster import LocalCluster
from router.tokenizer import RouterTokenizer
from tests.deploy.ray_support import make_prompts, serve_spec
from tests.deploy.test_adaptive_cluster import PROFILE
from tests.engine.test_structured_output import SCHEMA, _before_special

pytestmark = pytest.mark.slow  # starts worker processes, clusters or servers

PROMPTS = make_prompts((5, 12, 19, 8), seed=6)
# A random model given free whitespace spends its tokens on it: JSON without it (vLLM's flag)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
LAYOUTS = {
    "disaggregated": {},
    "disaggregated-tp2": {
        "prefill": {"tensor_parallel_size": 2},
        "decode": {"tensor_parallel_size": 2},
    },
    "colocated": {"mode": "colocated"},
    # two instances that prefill and decode as the router places each request
    "adaptive": {
        "mode": "adaptive",
        "adaptive": {"instances": 2},
        "router": {"http_port": 0, "latency_profile": str(PROFILE)},
    },
    # a constrained request proposes no drafts: its greedy answer equals a speculated one
    "disaggregated-speculative": {"speculative": {"method": "ngram", "num_tokens": 3}},
}


class Item(BaseModel):
    name: str = Field(max_length=6)
    size: int = Field(ge=0, le=99)
    kind: str = Field(pattern="^(box|bag)$")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(tiny_model_dir: str, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    spec = serve_spec(
        tiny_model_dir,
        dtype="float64",
        kv_cache={"block_size": 8, "num_blocks": 128},
        ray={"enabled": False},
        **{"router": {"http_port": 0}, **LAYOUTS[request.param]},
    )
    with LocalCluster(spec) as running:
        running.start()
        yield running


def _client(cluster: LocalCluster) -> openai.OpenAI:
    assert cluster.router is not None
    base_url = f"http://127.0.0.1:{cluster.router.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _model(cluster: LocalCluster) -> str:
    assert cluster.router is not None
    return cluster.router.config.model_name


def _generate(cluster: LocalCluster, **fields: object) -> list[int]:
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return list(stub.GenerateUnary(pb.GenerateRequest(**fields), timeout=120).token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_outputs_validate_greedy_and_sampled(cluster: LocalCluster, temperature) -> None:
    client = _client(cluster)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
    }
    for index, prompt in enumerate(PROMPTS):
        out = client.completions.create(
            model=_model(cluster),
            prompt=prompt,
            max_tokens=200,
            temperature=temperature,
            seed=index,
            n=2,
            extra_body={"response_format": response_format, **COMPACT},
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdk_parses_a_pydantic_response_format(cluster: LocalCluster, stream: bool) -> None:
    client = _client(cluster)
    messages = [{"role": "user", "content": "Describe a box."}]
    if not stream:
        out = client.chat.completions.parse(
            model=_model(cluster),
            messages=messages,
            max_tokens=200,
            response_format=Item,
            extra_body=COMPACT,
        )
        parsed = out.choices[0].message.parsed
    else:
        with client.chat.completions.stream(
            model=_model(cluster),
            messages=messages,
            max_tokens=200,
            response_format=Item,
            extra_body=COMPACT,
        ) as events:
            parsed = events.get_final_completion().choices[0].message.parsed
    assert isinstance(parsed, Item) and parsed.kind in ("box", "bag")
    assert len(parsed.name) <= 6 and 0 <= parsed.size <= 99


def test_greedy_under_an_admitting_grammar_is_the_unconstrained_answer(
    cluster: LocalCluster, tiny_model_dir: str
) -> None:
    tokenizer = RouterTokenizer(tiny_model_dir).hf_tokenizer
    checked = 0
    for prompt in PROMPTS:
        free = _generate(cluster, token_ids=prompt, max_tokens=16, ignore_eos=True)
        answer = _before_special(free)
        while answer and "\ufffd" in tokenizer.decode(answer, clean_up_tokenization_spaces=False):
            answer = answer[:-1]  # only whole characters can be spelled by a choice
        if len(answer) < 2:
            continue
        text = tokenizer.decode(answer, clean_up_tokenization_spaces=False)
        choice = pb.StructuredOutput(choice=pb.ChoiceList(choices=[text, "not the answer"]))
        constrained = _generate(
            cluster, token_ids=prompt, max_tokens=len(answer), structured_output=choice
        )
        assert constrained == answer
        checked += 1
    assert checked >= 2


def test_grpc_regex_and_choice_and_a_grammar_that_does_not_compile(cluster: LocalCluster) -> None:
    regex = pb.StructuredOutput(regex="[0-9]{2}-[a-d]{3}")
    ids = _generate(cluster, token_ids=PROMPTS[0], max_tokens=20, structured_output=regex)
    text = RouterTokenizer(cluster.router.config.model_dir).decode(ids)  # type: ignore[union-attr]
    assert re.fullmatch("[0-9]{2}-[a-d]{3}", text), text
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        bad = pb.GenerateRequest(
            token_ids=PROMPTS[0], structured_output=pb.StructuredOutput(grammar="root ::= nope")
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.GenerateUnary(bad, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "structured_output.grammar does not compile" in details and "nope" in details
