"""Tool calling's pieces without servers: the job's tool fields, the parsers, the forced-call
grammar (compiled by the engine's own compiler and checked with jsonschema), and the
fallback prompt of templates that know no tools (model_factory's, as SmolLM2's)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from model_factory import build_tokenizer

from conveyor.clients.errors import InvalidJob
from conveyor.clients.submission import build_job
from conveyor.clients.tool_grammar import MAX_PARALLEL_CALLS, forced_call_schema
from conveyor.clients.tool_parsers import ToolReading, parse
from conveyor.engine.chat_tools import chat_text, default_tool_parser, fallback_messages, knows_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CHAT = [{"role": "user", "content": "weather in Paris?"}]
HISTORY = CHAT + [
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def job(**fields):
    return build_job({"messages": CHAT, "tools": [WEATHER, TIME], **fields})


# ---------------------------------------------------------------- the job's fields


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tool_choice": "required", "structured_outputs": {"json_object": True}}, "tool_choice"),
        ({"messages": None, "prompt": "hi"}, "tools"),
        (
            {"messages": [{"role": "user", "tool_calls": HISTORY[1]["tool_calls"], "content": "x"}]},
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": float("nan")}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_fields_name_the_field(fields, field):
    with pytest.raises(InvalidJob) as failure:
        job(**fields)
    assert failure.value.field == field, failure.value.message


def test_a_history_with_calls_and_results_is_a_valid_job_and_part_of_its_digest():
    from conveyor.clients.protocol import payload_digest

    with_calls = build_job({"messages": HISTORY, "tools": [WEATHER]})
    other = build_job({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "required"})
    plain = build_job({"messages": CHAT})
    assert with_calls.chat_messages()[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert len({payload_digest(with_calls), payload_digest(other), payload_digest(plain)}) == 3
    assert plain.chat_messages() == CHAT  # jobs without tools keep their shape (and digest)


# ---------------------------------------------------------------- parsers


def test_hermes_reads_calls_after_content_and_llama3_reads_json_calls():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    assert parse(text, "hermes") == ("Let me look.", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    assert parse("no call here", "hermes") is None
    llama = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    )
    assert parse(llama, "llama3_json") == ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert parse("It is sunny.", "llama3_json") is None


def test_unreadable_or_unknown_calls_come_back_as_content_with_the_reason():
    reading = ToolReading("auto", "hermes", ("get_weather",), "job-1")
    broken = reading.read('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>')
    assert (
        broken.tool_calls is None and broken.content.startswith("<tool_call>") and "not JSON" in broken.tool_call_error
    )
    unknown = reading.read('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert unknown.tool_calls is None and "rm_rf" in unknown.tool_call_error
    good = reading.read('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', index=1)
    assert [(c.name, json.loads(c.arguments)) for c in good.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert (
        good.tool_calls[0].id
        == reading.read('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', index=1).tool_calls[0].id
    )  # per job and index


# ---------------------------------------------------------------- forced calls: a grammar over the schemas


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from conveyor.engine.grammar_compiler import GrammarCompiler

    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tool_tokenizer"))
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


@pytest.mark.parametrize(
    "choice, parallel",
    [("required", True), ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, True)],
)
def test_forced_call_schemas_compile_and_read_back(compiler, choice, parallel):
    request = job(tool_choice=choice, parallel_tool_calls=parallel)
    structured = forced_call_schema(request.tools, request.tool_choice, parallel)
    from conveyor.engine.structured_outputs import StructuredOutputsParams

    params = StructuredOutputsParams(**structured)
    params.validate()
    compiler.compile(params)
    schema = structured["json"]
    if choice == "required":
        output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
        jsonschema.validate(json.loads(output), schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
        assert schema["maxItems"] == (MAX_PARALLEL_CALLS if parallel else 1)
        mode = "required"
    else:
        output = '{"city": "Paris"}'
        jsonschema.validate(json.loads(output), schema)
        mode = "named"
    names = ("get_weather",) if mode == "named" else ("get_weather", "get_time")
    read = ToolReading(mode, "hermes", names, "j").read(output)
    assert read.tool_calls[0].name == "get_weather" and read.tool_call_error is None


def test_a_required_list_cut_by_max_tokens_or_repeating_itself_gives_its_calls():
    """Issue 39 item 12: SmolLM2 under tool_choice="required" repeated one call until max_tokens
    and the reply was the raw cut list as content (finish_reason length, no tool_calls)."""
    reading = ToolReading("required", "hermes", ("get_weather", "get_time"), "j")
    call = '{"name":"get_weather","parameters":{"city":"Oslo"}}'
    other = '{"name":"get_time","parameters":{"zone":"UTC"}}'
    cut = reading.read(f'[{call},{other},{call},{call},{{"name":"get_wea')
    assert [(c.name, json.loads(c.arguments)) for c in cut.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "UTC"}),
    ], "complete calls before the cut, and the list ends at the first word-for-word repeat"
    assert cut.tool_call_error is None and cut.content is None
    assert len(reading.read(f"[{call},{other}]").tool_calls) == 2
    for unreadable in ("[", '[{"name":"get_w', "", "not a list", '{"name": "get_weather"}'):
        assert reading.read(unreadable).tool_call_error, unreadable


# ---------------------------------------------------------------- the fallback prompt


def test_templates_without_tools_get_the_stated_fallback_and_templates_with_tools_get_them(tmp_path):
    plain = build_tokenizer(tmp_path)
    assert not knows_tools(plain) and default_tool_parser(plain) == "hermes"
    messages = fallback_messages(HISTORY, [WEATHER])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in messages[0]["content"]
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3]["content"] == (
        "The tool get_weather returned: sunny, 21C\n\nAnswer the user's question using this result, in plain words."
    )
    text = chat_text(plain, HISTORY, [WEATHER])
    assert text.endswith("<|im_start|>assistant\n") and "<tool_response>" not in text

    from tool_model import HERMES_TEMPLATE

    plain.chat_template = HERMES_TEMPLATE
    assert knows_tools(plain)
    assert chat_text(plain, HISTORY, [WEATHER]) == plain.apply_chat_template(
        [
            *HISTORY[:1],
            {
                **HISTORY[1],
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "id": "call_1",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            HISTORY[2],
        ],
        tools=[WEATHER],
        tokenize=False,
        add_generation_prompt=True,
    )
