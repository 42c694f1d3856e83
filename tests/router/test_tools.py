"""OpenAI tool calling through a real router and a real engine worker, with the openai SDK:
`required` and a named function constrain the output to the tools' schemas and come back as
`tool_calls` (whole and streamed, parsed by the SDK's own helpers); `auto` reads the calls in the
chat template's format; tool results render through the template; misuse gets a 400 by field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from deploy.runtime.handle import LocalHandle
from engine.config import EngineConfig
from router.config import RouterConfig
from router.http_api.tool_parsers import HermesParser, Llama3JsonParser, parser_for_template
from router.tokenizer import RouterTokenizer
from tests.router.harness import RouterThread
from worker.config import WorkerConfig
from worker.instance import Worker
from worker.protocol import Role

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
# what the Qwen-style template renders must fit the tiny model's 512 tokens
SHORT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# A Qwen-style template: tools in the system turn, calls in <tool_call> tags, tool answers
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>{% for tool in tools %}{{ tool | tojson }}{% endfor %}\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|tool|><tool_response>{{ message.content }}"
    "</tool_response>\n"
    "{%- elif message.tool_calls %}<|assistant|>{% for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}\n"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Weather(BaseModel):
    city: str = Field(max_length=6)
    days: int = Field(ge=1, le=3)


def _serve(model_dir: str) -> RouterThread:
    engine_config = EngineConfig(model_dir=model_dir, dtype="float64", block_size=8)
    config = RouterConfig(model_dir=model_dir, http_port=0, load_refresh_interval_s=0.02)

    def make_handles():
        worker = Worker(WorkerConfig(engine_config), "colocated-0")
        return [LocalHandle("colocated-0", Role.COLOCATED, worker)], []

    return RouterThread(config, make_handles)


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: str, hermes_model_dir: str) -> Iterator[dict[str, RouterThread]]:
    with _serve(tiny_model_dir) as plain, _serve(hermes_model_dir) as hermes:
        yield {"plain": plain, "hermes": hermes}


def _client(server: RouterThread) -> openai.OpenAI:
    assert server.router is not None
    base_url = f"http://127.0.0.1:{server.router.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def _model(server: RouterThread) -> str:
    assert server.router is not None
    return server.router.config.model_name


def _create(server: RouterThread, stream: bool = False, **fields):
    body = {"model": _model(server), "messages": MESSAGES, "max_tokens": 400, "temperature": 0}
    body.update(fields)
    body.setdefault("extra_body", COMPACT)
    client = _client(server)
    if not stream:
        return client.chat.completions.create(**body)
    return list(client.chat.completions.create(stream=True, **body))


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The SDK's chunks folded as a client does: calls by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish_reason


def test_required_calls_follow_the_tools_schemas_whole_and_streamed(servers) -> None:
    server = servers["plain"]
    whole = _create(server, tools=TOOLS, tool_choice="required")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed, finish_reason = _streamed_calls(
        _create(server, True, tools=TOOLS, tool_choice="required")
    )
    assert finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert all(c["id"] for c in streamed)
    single = _create(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_its_arguments_whole_and_streamed(servers) -> None:
    server = servers["plain"]
    named = {"type": "function", "function": {"name": "clock"}}
    whole = _create(server, tools=TOOLS, tool_choice=named)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "clock"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK)
    chunks = _create(server, True, tools=TOOLS, tool_choice=named)
    streamed, finish_reason = _streamed_calls(chunks)
    assert finish_reason == "stop"
    assert [(c["name"], c["arguments"]) for c in streamed] == [("clock", call.function.arguments)]
    # the arguments came in more than one delta, as they were generated
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()]
    assert len(deltas) > 2


def test_the_sdk_parses_a_pydantic_function_tool(servers) -> None:
    server = servers["plain"]
    out = _client(server).chat.completions.parse(
        model=_model(server),
        messages=MESSAGES,
        max_tokens=120,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        extra_body=COMPACT,
    )
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and len(parsed.city) <= 6 and 1 <= parsed.days <= 3


def test_auto_reads_the_templates_tool_call_format(servers) -> None:
    server = servers["hermes"]
    # the model is random: a grammar makes it write a call in the template's format
    call = '<tool_call>{"name": "weather", "arguments": {"city": "'
    grammar = f"root ::= {json.dumps(call)} [a-z]{{1,6}} " + json.dumps(
        '", "days": 2}}</tool_call>'
    )
    fields = {
        "tools": SHORT_TOOLS,
        "tool_choice": "auto",
        "extra_body": {"guided_grammar": grammar},
    }
    whole = _create(server, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (parsed,) = choice.message.tool_calls
    assert parsed.function.name == "weather"
    jsonschema.validate(json.loads(parsed.function.arguments), WEATHER)
    streamed, finish_reason = _streamed_calls(_create(server, True, **fields))
    assert finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        ("weather", parsed.function.arguments)
    ]


def test_tool_results_render_through_the_chat_template(servers, hermes_model_dir: str) -> None:
    server = servers["hermes"]
    arguments = '{"city": "Paris", "days": 1}'
    conversation = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = _create(server, messages=conversation, tools=SHORT_TOOLS, max_tokens=2, extra_body={})
    tokenizer = RouterTokenizer(hermes_model_dir)
    rendered = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": json.loads(arguments)},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]
    expected = tokenizer.encode_chat(rendered, SHORT_TOOLS)
    assert out.usage.prompt_tokens == len(expected)
    text = tokenizer.hf_tokenizer.decode(expected)
    assert "<tool_response>sunny, 21 C</tool_response>" in text and '"name": "weather"' in text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # the template has no format
        ({"tools": TOOLS}, "tool_choice"),  # auto is the default with tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objekt"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_misused_tools_get_a_400_naming_the_field(servers, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(servers["plain"], **fields)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, (
        caught.value.body
    )


def test_tool_none_answers_with_content(servers) -> None:
    out = _create(servers["plain"], tools=TOOLS, tool_choice="none", max_tokens=4, extra_body={})
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def test_parsers_split_content_from_calls() -> None:
    hermes = HermesParser()
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = hermes.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1})
    ]
    assert hermes.parse("<tool_call>{not json</tool_call>") == (
        "<tool_call>{not json</tool_call>",
        [],
    )
    assert hermes.safe_prefix("Sure <tool") == len("Sure ") and hermes.safe_prefix("abc") == 3
    llama = Llama3JsonParser()
    content, calls = llama.parse(
        '<|python_tag|>{"name": "a", "parameters": {"y": 2}}; {"name": "b", "parameters": {}}'
    )
    assert (
        content == ""
        and [c.name for c in calls] == ["a", "b"]
        and json.loads(calls[0].arguments) == {"y": 2}
    )
    assert llama.parse("It is sunny.") == ("It is sunny.", [])
    assert llama.safe_prefix("It is") == 5 and llama.safe_prefix(' {"na') == 0
    assert isinstance(parser_for_template(HERMES_TEMPLATE), HermesParser)
    assert parser_for_template("{{ messages }}") is None
