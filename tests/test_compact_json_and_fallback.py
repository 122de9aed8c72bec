"""Issue 40 items 3 and 4.

Compact JSON by default: under `json` and `json_object` no whitespace outside strings but
the one space after each `,` and `:` (xgrammar's compact form, as vLLM's
disable_any_whitespace), so a model cannot spend max_tokens on blank lines;
`whitespace: "any"` gives the old grammar. Jobs that say nothing keep their digest.

The tool-calling fallback stays invisible: tool results reach a model whose template knows
no tools in plain words, and the reader strips the markup a model echoes.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conveyor.clients.errors import InvalidJob
from conveyor.clients.protocol import payload_digest
from conveyor.clients.submission import build_job
from conveyor.clients.tool_parsers import ToolReading, parse
from conveyor.engine import InvalidRequest, SamplingParams, StructuredOutputsParams
from conveyor.engine.chat_tools import fallback_messages
from conveyor.engine.grammar_compiler import JSON_OBJECT_SCHEMA, constraint_key
from conveyor.engine.structured_outputs import schema_text

# strings bounded and ASCII: a compact output is at most ~90 tokens, whatever the model does
DOG = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "bio": {"type": "string", "pattern": "^[A-Za-z ,.]{1,40}$"},
    },
    "required": ["name", "age", "bio"],
}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def free_whitespace(text: str) -> bool:
    """Whitespace outside strings other than the one space after `,` and `:`."""
    bare = STRING.sub('""', text).replace(", ", ",").replace(": ", ":")
    return any(c in bare for c in " \t\r\n")


# ---------------------------------------------------------------- the option


@pytest.mark.parametrize(
    "given, any_whitespace",
    [
        ({}, False),
        ({"disable_any_whitespace": True}, False),
        ({"disable_any_whitespace": False}, False),  # vLLM's default value: compact here too
        ({"whitespace": "compact"}, False),
        ({"whitespace": "any"}, True),
    ],
)
def test_json_is_compact_unless_any_whitespace_is_asked(given, any_whitespace):
    for constraint, text in (({"json": DOG}, schema_text(DOG)), ({"json_object": True}, JSON_OBJECT_SCHEMA)):
        params = StructuredOutputsParams(**constraint, **given)
        params.validate()
        assert constraint_key(params) == ("json", text, any_whitespace)
    regex = StructuredOutputsParams(regex="a+", **given)
    regex.validate()
    assert constraint_key(regex) == ("regex", "a+", False)  # only JSON has whitespace to allow


@pytest.mark.parametrize(
    "given", [{"whitespace": "some"}, {"whitespace": True}, {"whitespace": "any", "disable_any_whitespace": True}]
)
def test_a_bad_or_contradicting_whitespace_option_is_refused(given):
    with pytest.raises(InvalidRequest) as failure:
        StructuredOutputsParams(json=DOG, **given).validate()
    assert failure.value.field == "structured_outputs.whitespace"
    with pytest.raises(InvalidJob):
        build_job({"prompt": "hi", "structured_outputs": {"json": DOG, **given}})


def test_jobs_that_say_nothing_keep_their_digest_and_any_whitespace_has_its_own():
    def digest(so: dict | None) -> str:
        return payload_digest(build_job({"prompt": "Yes or no?", "structured_outputs": so}))

    # docs/protocol.md's vector, unchanged
    assert (
        digest({"choice": ["yes", "no"], "disable_any_whitespace": True})
        == "7c14c72fc684996a06f5d525cc90fe86a4daf86342e20e56f0db2224f67850f6"
    )
    plain = digest({"json": DOG})
    assert digest({"json": DOG, "disable_any_whitespace": False}) == plain  # a default, as before
    assert digest({"json": DOG, "whitespace": None}) == plain
    assert len({plain, digest({"json": DOG, "whitespace": "any"}), digest({"json": DOG, "whitespace": "compact"})}) == 3
    job = build_job({"prompt": "hi", "structured_outputs": {"json": DOG, "whitespace": "any"}})
    assert job.sampling_params()["structured_outputs"] == {"json": DOG, "whitespace": "any"}
    assert build_job({"prompt": "hi", "structured_outputs": {"json": DOG}}).sampling_params()["structured_outputs"] == {
        "json": DOG
    }
    # what the replica builds from the job's map
    assert SamplingParams(structured_outputs={"json": DOG, "whitespace": "any"}).structured_outputs.any_whitespace


# ---------------------------------------------------------------- on SmolLM2, temperature 1


@pytest.fixture(scope="module")
def smollm2():
    from conveyor.engine import LLM

    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_memory="128MiB")


@pytest.mark.slow
def test_smollm2_json_at_temperature_1_is_valid_and_compact_and_any_whitespace_is_the_old_grammar(smollm2):
    chat = [{"role": "user", "content": "Invent a cool dog. Reply as JSON."}]

    def run(n=16, **given):
        params = [
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=100,
                structured_outputs=StructuredOutputsParams(json=DOG, **given),
            )
            for seed in range(n)
        ]
        return smollm2.chat([chat] * n, params, use_tqdm=False)

    compact = run()
    assert [o.finish_reason for o in compact] == ["stop"] * 16, [o.text for o in compact]
    for output in compact:
        jsonschema.validate(json.loads(output.text), DOG)
        assert not free_whitespace(output.text), output.text
    spaced = run(8, whitespace="any")
    assert sum(free_whitespace(o.text) for o in spaced) >= 2, [o.text for o in spaced]  # SmolLM2: most of them
    compiled = smollm2.engine.inputs._grammar_compiler().cache
    assert ("json", schema_text(DOG), True) in compiled and ("json", schema_text(DOG), False) in compiled


# ---------------------------------------------------------------- the tool-calling fallback

CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
HISTORY = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00\nCET"},
]
TAGS = re.compile(r"</?(?:tool_response|tools|tool_call)>")


def test_fallback_tool_results_are_plain_words():
    one = fallback_messages(HISTORY[:3], None)
    assert one[-1] == {
        "role": "user",
        "content": "The tool get_weather returned: sunny, 21C\n\n"
        "Answer the user's question using this result, in plain words.",
    }
    both = fallback_messages(HISTORY, None)
    assert [m["role"] for m in both] == ["user", "assistant", "user"]
    assert both[-1]["content"] == (
        "The tool get_weather returned: sunny, 21C\nThe tool get_time returned:\n12:00\nCET\n\n"
        "Answer the user's question using these results, in plain words."
    )
    unknown = fallback_messages([*HISTORY[:2], {"role": "tool", "tool_call_id": "call_9", "content": "42"}], None)
    assert unknown[-1]["content"].startswith("A tool returned: 42\n\n")
    for message in both + unknown:
        if message["role"] != "assistant":  # the model's own calls keep the format it is asked to write
            assert not TAGS.search(message["content"]), message


@pytest.mark.parametrize(
    "text, content",
    [
        ("<tool_response>\nsunny, 21C\n</tool_response>\nIt is sunny in Paris.", "sunny, 21C\nIt is sunny in Paris."),
        ("The result <tool_response>sunny</tool_response> means sun.", "The result sunny means sun."),
        ("<tools>\n</tools>\nHello!", "Hello!"),
        ("It is sunny. <tool_call>", "It is sunny."),  # a dangling tag
        ("<tool_call>\nIt is sunny in Paris.", "It is sunny in Paris."),  # an unclosed tag before prose
        ("<tool_call></tool_call>\nIt is sunny.", "It is sunny."),  # an empty call
    ],
)
def test_an_answer_comes_back_without_fallback_markup(text, content):
    read = ToolReading("auto", "hermes", ("get_weather",), "job-1").read(text)
    assert read.tool_calls is None and read.tool_call_error is None
    assert read.content == content


def test_real_calls_still_parse_and_markup_around_them_is_stripped():
    reading = ToolReading("auto", "hermes", ("get_weather", "get_time"), "job-1")
    text = (
        "Let me look.\n<tool_response>\n</tool_response>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call></tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    read = reading.read(text)
    assert [(c.name, json.loads(c.arguments)) for c in read.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert read.content == "Let me look."
    assert reading.read("It is sunny.").model_dump(exclude_none=True) == {}  # plain text: the text itself, as before
    assert parse("no call here", "hermes") is None
    broken = reading.read(
        '<tool_response>x</tool_response><tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    )
    assert broken.tool_call_error and broken.content.startswith("x <tool_call>{")  # a broken call stays an error
    named = ToolReading("named", "hermes", ("get_weather",), "job-1").read('{"city": "Oslo"}')
    assert named.tool_calls[0].arguments == '{"city": "Oslo"}' and named.content is None
