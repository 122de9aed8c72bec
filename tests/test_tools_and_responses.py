"""Tool calling and the Responses API end to end: one real `conveyor serve` replica of a tiny
Qwen2 model whose chat template knows tools (tests/tool_model.py), a gateway with the
Responses routes on the session's Valkey, and the real clients unchanged: the openai SDK
(chat tools, responses.create) and LangChain's ChatOpenAI (bind_tools, with_structured_output).

The model is random, so what it says is noise; what is checked is what the server owns:
the prompt it rendered (token counts against transformers' own template with tools=),
forced calls whose arguments validate against the tool's schema, calls and their deltas,
stored and chained responses, background jobs and their cancel."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest
from fault_harness import ServeProcess, wait_until
from gateway_harness import GatewayThread, openai_client
from lora_adapter import make_adapter
from tool_model import build_tool_model
from transformers import AutoTokenizer

MODEL, ADAPTER = "tiny-tools", "terse"
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast for a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    from conveyor.gateway import batch_routes, responses

    log_dir = tmp_path_factory.mktemp("tools_logs")
    model_dir = build_tool_model(tmp_path_factory.mktemp("tool_model"))
    adapter_dir = make_adapter(
        model_dir, tmp_path_factory.mktemp("tool_adapter"), 3, ["q_proj", "v_proj", "down_proj"], 4
    )
    ns = f"tools-{uuid.uuid4().hex[:10]}"
    replica = ServeProcess(
        model_dir,
        redis_url,
        ns,
        "tools-replica",
        log_dir,
        args=["--served-model-name", MODEL, "--max-model-len", "1024", "--lora-modules", f"{ADAPTER}={adapter_dir}"],
    ).start()
    gateway = GatewayThread(redis_url, ns, extra_routers=(batch_routes.router, responses.router))
    try:
        replica.wait_ready(timeout=180)
        gateway.start()
        sdk = openai_client(gateway)
        wait_until(
            lambda: [m.id for m in sdk.models.list().data] == [MODEL, ADAPTER],
            60,
            "the gateway to list the model and its adapter",
        )
        yield Stack(gateway, sdk, AutoTokenizer.from_pretrained(model_dir), redis_url, ns, model_dir, adapter_dir)
    finally:
        gateway.stop()
        replica.stop()


class Stack:
    def __init__(self, gateway, sdk, tokenizer, redis_url, ns, model_dir, adapter_dir):
        self.gateway, self.sdk, self.tokenizer, self.redis_url, self.ns = gateway, sdk, tokenizer, redis_url, ns
        self.model_dir, self.adapter_dir = model_dir, adapter_dir

    def prompt_tokens(self, messages, tools=None) -> int:
        """Tokens of transformers' own rendering (call arguments as objects, as its templates expect)."""
        rendered = [
            {
                **m,
                "content": m.get("content") or "",
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]
        text = self.tokenizer.apply_chat_template(rendered, tools=tools, tokenize=False, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMS[call.function.name])
        out.append((call.function.name, arguments))
    return out


# ---------------------------------------------------------------- chat completions with tools


def test_required_returns_calls_whose_arguments_validate(stack):
    reply = stack.sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = valid_calls(choice.message.tool_calls)
    assert len(calls) == 1 and choice.message.tool_calls[0].id.startswith("call_")
    assert reply.usage.prompt_tokens == stack.prompt_tokens(ASK, TOOLS)  # rendered by the template with tools=


def test_a_named_function_is_called_and_its_arguments_stream_as_deltas(stack):
    request = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    whole = stack.sdk.chat.completions.create(**request)
    [(name, arguments)] = valid_calls(whole.choices[0].message.tool_calls)
    assert name == "get_time"
    pieces, names, ids, finish = [], [], set(), None
    for chunk in stack.sdk.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            pieces.append(delta.function.arguments or "")
            names += [delta.function.name] if delta.function.name else []
            ids |= {delta.id} if delta.id else set()
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_time"] and len(ids) == 1 and ids.pop().startswith("call_")  # ids are per job
    assert len(pieces) > 1 and json.loads("".join(pieces)) == arguments and finish == "tool_calls"


def test_required_calls_stream_as_openai_deltas(stack):
    request = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=160,
        parallel_tool_calls=False,
    )
    whole = stack.sdk.chat.completions.create(**request).choices[0].message.tool_calls
    assert whole
    calls: dict[int, dict] = {}
    for chunk in stack.sdk.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]  # greedy: the same calls
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_reads_the_output_and_a_history_with_results_is_rendered_by_the_template(stack):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21C"},
    ]
    reply = stack.sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == stack.prompt_tokens(history, TOOLS)
    # a random model writes no <tool_call>: its text is the content, as said
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason in ("stop", "length")
    none = stack.sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "structured_outputs.json",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_tools_that_cannot_be_served_are_400_naming_the_field(stack, extra, param):
    with pytest.raises(openai.BadRequestError) as failure:
        stack.sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **extra)
    assert failure.value.param == param, failure.value.body


# ---------------------------------------------------------------- the Responses API


def test_responses_plain_and_streamed_agree_and_are_stored(stack):
    request = dict(model=MODEL, input="Say hello.", instructions="Be brief.", temperature=0, max_output_tokens=12)
    plain = stack.sdk.responses.create(**request)
    assert plain.status in ("completed", "incomplete") and plain.output_text and plain.id.startswith("resp_")
    assert plain.usage.input_tokens == stack.prompt_tokens(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    )
    assert stack.sdk.responses.retrieve(plain.id).output_text == plain.output_text
    kinds, deltas, final = [], [], None
    for event in stack.sdk.responses.create(**request, stream=True):
        kinds.append(event.type)
        deltas += [event.delta] if event.type == "response.output_text.delta" else []
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(deltas) == final.output_text == plain.output_text


def test_previous_response_id_continues_the_conversation(stack):
    first = stack.sdk.responses.create(
        model=MODEL, input="Name a city.", instructions="Be brief.", temperature=0, max_output_tokens=6
    )
    second = stack.sdk.responses.create(
        model=MODEL, input="And another?", previous_response_id=first.id, temperature=0, max_output_tokens=6
    )
    conversation = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]  # the instructions are not carried over
    assert second.usage.input_tokens == stack.prompt_tokens(conversation)
    with pytest.raises(openai.NotFoundError):
        stack.sdk.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    unstored = stack.sdk.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        stack.sdk.responses.retrieve(unstored.id)


def test_responses_function_tool_call_and_its_output_round_trip(stack):
    tool = {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS}
    called = stack.sdk.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    streamed = [
        event
        for event in stack.sdk.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            tools=[tool],
            tool_choice="required",
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    ]
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == [call.arguments]
    answer = stack.sdk.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        tools=[tool],
        temperature=0,
        max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert answer.usage.input_tokens == stack.prompt_tokens(
        history,
        [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS},
            }
        ],
    )


def test_responses_json_schema_output_validates(stack):
    schema = {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}
    reply = stack.sdk.responses.create(
        model=MODEL,
        input="Forecast?",
        temperature=0,
        max_output_tokens=300,
        text={"format": {"type": "json_schema", "name": "forecast", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_background_responses_are_polled_and_cancelled(stack):
    quick = stack.sdk.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4)
    assert quick.status == "queued"
    wait_until(
        lambda: stack.sdk.responses.retrieve(quick.id).status in ("completed", "incomplete"),
        60,
        "the background response to finish",
    )
    assert stack.sdk.responses.retrieve(quick.id).output_text
    long = stack.sdk.responses.create(
        model=MODEL, input="Count.", background=True, max_output_tokens=900, extra_body={"ignore_eos": True}
    )
    cancelled = stack.sdk.responses.cancel(long.id)
    assert cancelled.status == "cancelled", cancelled.status
    foreground = stack.sdk.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        stack.sdk.responses.cancel(foreground.id)


# ---------------------------------------------------------------- LangChain


def test_langchain_bind_tools_and_with_structured_output(stack):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        """The forecast to report."""

        city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo"]})
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(
        model=MODEL, base_url=stack.gateway.base_url, api_key="unused", temperature=0, max_tokens=120, max_retries=0
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris for 2 days?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    forecast = llm.with_structured_output(Forecast).invoke("Forecast?")
    assert isinstance(forecast, Forecast) and forecast.city in ("Paris", "Oslo")


# ---------------------------------------------------------------- LoRA adapters through the queue


def test_an_adapter_named_by_model_runs_through_the_queue_as_offline(stack):
    from conveyor.clients import Client
    from conveyor.engine import LLM, LoRARequest, SamplingParams

    [listed] = [m for m in stack.sdk.models.list().data if m.id == ADAPTER]
    assert listed.parent == MODEL
    ids = stack.tokenizer.encode(
        stack.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    offline = LLM(stack.model_dir, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    adapter = LoRARequest(ADAPTER, 1, stack.adapter_dir)
    [expected] = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False, lora_request=adapter)
    [base] = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert expected.outputs[0].token_ids != base.outputs[0].token_ids
    for model in (ADAPTER, f"{MODEL}:{ADAPTER}"):
        reply = stack.sdk.chat.completions.create(
            model=model, messages=ASK, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].message.content == expected.outputs[0].text, model
    plain = stack.sdk.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].message.content == base.outputs[0].text
    with pytest.raises(openai.NotFoundError):
        stack.sdk.chat.completions.create(model=f"{MODEL}:nope", messages=ASK, max_tokens=2)
    with Client(stack.redis_url, stack.ns) as client:  # a producer naming an adapter nobody serves
        job = client.submit(messages=ASK, model=MODEL, lora="nope", max_tokens=2)
        with pytest.raises(Exception) as failure:
            job.result(timeout=60)
        assert "lora" in str(failure.value) and "terse" in str(failure.value)
