"""Structured outputs (xgrammar). On a tiny random model the grammar alone has to make the
output valid: every output under a JSON schema parses and validates (jsonschema), regex and
choice outputs match, and a constraint that cannot be compiled fails its request alone.
Greedy structured outputs are token-identical to transformers' greedy generate under
xgrammar's own logits processor, in every scheduling regime (preemption recomputes a
sequence: its matcher must not see a token twice). Then over a real replica, through the
gateway with the openai SDK (response_format), and on SmolLM2 (slow)."""

import json
import re

import jsonschema
import openai
import pydantic
import pytest
import redis
import torch
import xgrammar as xgr
from fault_harness import wait_until
from gateway_harness import GatewayThread, openai_client
from model_factory import _load, mixed_prompts
from replica_harness import ReplicaThread

from conveyor.clients import Client
from conveyor.clients.errors import JobFailed
from conveyor.clients.keys import Keys
from conveyor.engine import LLM, InvalidRequest, SamplingParams, StructuredOutputsParams, grammar_compiler

MODEL = "tiny-structured"
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
# Bounded on purpose (string lengths, item counts, number ranges): a random model would
# otherwise run on to max_tokens inside an endless string; the grammar forces the rest.
SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    "admin": {"type": "boolean"},
                },
                "required": ["name", "admin"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue", 7, None]},
        "minItems": 1,
        "maxItems": 4,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": -5, "maximum": 5},
            "score": {"type": "number", "minimum": -10.5, "maximum": 10.5},
        },
        "required": ["ratio", "count", "score"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"k": {"const": "v"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "n"],
            "additionalProperties": False,
        },
    },
    "any_of_and_ref": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {
            "at": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "kind": {"enum": ["a", "b", None]},
        },
        "required": ["at", "tags"],
        "additionalProperties": False,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [{"type": "boolean"}, {"enum": ["x", "y"]}],
        "items": False,
        "minItems": 2,
    },
}
REGEXES = [r"\d{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}", r"0x[0-9a-f]{1,8}"]
CHOICES = ["positive", "negative", "neutral", 'it\'s "complicated"']
GRAMMAR = 'root ::= "(" digit (op digit){0,3} ")"\ndigit ::= [0-9]\nop ::= "+" | "-" | "*"'
GRAMMAR_REGEX = r"\([0-9]([+\-*][0-9]){0,3}\)"
MAX_TOKENS = 300
REGIMES = {
    "ample_kv": {},
    "preemption": dict(num_kv_blocks=64, block_size=4),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "overlapped": dict(async_scheduling=True),
    "overlapped_preemption": dict(async_scheduling=True, num_kv_blocks=64, block_size=4),
    "overlapped_chunked_prefill": dict(async_scheduling=True, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(768, n=4, seed=5, min_len=3, max_len=40)


def structured(sampled: int | None = None, max_tokens: int = MAX_TOKENS, **constraint) -> SamplingParams:
    """Greedy, or sampled with seed ``sampled``; JSON without whitespace unless asked."""
    if ("json" in constraint or "json_object" in constraint) and "whitespace" not in constraint:
        constraint.setdefault("disable_any_whitespace", True)
    sampling = dict(temperature=0.0) if sampled is None else dict(temperature=1.0, seed=sampled)
    return SamplingParams(**sampling, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint))


def validate(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ---------------------------------------------------------------- outputs match their constraint


def test_every_output_validates_against_its_schema(llm, prompts):
    """Greedy and sampled rows of six schemas, and unconstrained rows, in one batch."""
    requests = [
        (name, prompt, structured(None if i % 2 == 0 else i, json=schema))
        for name, schema in SCHEMAS.items()
        for i, prompt in enumerate(prompts)
    ]
    plain = SamplingParams(temperature=0, max_tokens=12)
    outputs = llm.generate(
        [p for _, p, _ in requests] + prompts[:2], [s for _, _, s in requests] + [plain, plain], use_tqdm=False
    )
    for (name, _, _), output in zip(requests, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        assert output.token_ids[-1] in llm.engine.spec.eos_token_ids
        validate(output.text, SCHEMAS[name])
    alone = llm.generate(prompts[:2], plain, use_tqdm=False)
    assert [o.token_ids for o in outputs[-2:]] == [o.token_ids for o in alone]  # the masks touch only their rows
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0  # six requests per prompt: cached prefixes


def test_a_schema_given_as_text_and_any_whitespace(llm, prompts):
    schema = SCHEMAS["tuple"]
    params = [structured(json=json.dumps(schema)), structured(3, json=schema, whitespace="any")]
    for output in llm.generate(prompts[:2], params, use_tqdm=False):
        assert output.finish_reason == "stop"
        validate(output.text, schema)


def test_regex_choice_and_grammar_outputs_match(llm, prompts):
    cases = [(re.compile(regex), dict(regex=regex)) for regex in REGEXES]
    cases += [
        (re.compile("|".join(map(re.escape, CHOICES))), dict(choice=CHOICES)),
        (re.compile(GRAMMAR_REGEX), dict(grammar=GRAMMAR)),
    ]
    requests = [
        (pattern, prompt, structured(None if i % 2 == 0 else i + 10, **constraint))
        for pattern, constraint in cases
        for i, prompt in enumerate(prompts)
    ]
    outputs = llm.generate([p for _, p, _ in requests], [s for _, _, s in requests], use_tqdm=False)
    for (pattern, _, _), output in zip(requests, outputs):
        assert output.finish_reason == "stop" and pattern.fullmatch(output.text), (pattern.pattern, output.text)


def test_json_object_is_an_object(llm, prompts):
    outputs = llm.generate(prompts, [structured(i + 20, json_object=True) for i in range(len(prompts))], use_tqdm=False)
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outputs]  # a free object may run past max_tokens; most end
    for output in finished:
        assert isinstance(json.loads(output.text), dict)
    for output in outputs:
        assert output.text.startswith("{")


def test_every_sample_of_an_n_request_follows_the_constraint(llm, prompts):
    """n > 1: the children share the compiled grammar, each with a matcher of its own."""
    params = structured(7, json=SCHEMAS["tuple"])
    params.n = 4
    choices = structured(8, choice=CHOICES)
    choices.n = 3
    many, few = llm.generate(prompts[:2], [params, choices], use_tqdm=False)
    assert len(many.outputs) == 4 and len(few.outputs) == 3
    for sample in many.outputs:
        assert sample.finish_reason == "stop", sample.text
        validate(sample.text, SCHEMAS["tuple"])
    assert all(sample.text in CHOICES for sample in few.outputs)


# ---------------------------------------------------------------- failures stay with their request


def test_a_constraint_that_cannot_be_compiled_fails_alone(llm, prompts):
    bad = [
        ("structured_outputs.json", dict(json={"type": "foo"})),
        ("structured_outputs.json", dict(json={"properties": {"n": {"type": "integer", "multipleOf": 2}}})),
        ("structured_outputs.json", dict(json="{not json")),
        ("structured_outputs.regex", dict(regex="a(b")),
        ("structured_outputs.grammar", dict(grammar="root ::= undefined_rule")),
        ("structured_outputs.choice", dict(choice=[])),
        ("structured_outputs", dict(regex="a", choice=["a"])),
    ]
    good = [structured(json=SCHEMAS["numbers"]), structured(regex=REGEXES[0])]
    params = [good[0]] + [structured(**constraint) for _, constraint in bad] + [good[1]]
    outputs = llm.generate([prompts[0]] * len(params), params, use_tqdm=False)
    for (field, _), output in zip(bad, outputs[1:-1]):
        assert output.finish_reason == "error" and output.error.startswith(field + ": "), output.error
    validate(outputs[0].text, SCHEMAS["numbers"])
    assert re.fullmatch(REGEXES[0], outputs[-1].text)


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"properties": {"a": {"items": {"uniqueItems": True}}}}, "#/properties/a/items: 'uniqueItems'"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' is not supported"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one"),
        ({"$ref": "https://example.com/s.json"}, "'$ref' must point into this schema"),
        ({"type": "string", "format": "color"}, "format 'color' is not supported"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "next to pattern/format"),
        ({"type": "string", "pattern": "^a{1,5000}$"}, "#/pattern: repetition bound 5000"),
        (json.loads('{"items":' * 40 + "{}" + "}" * 40), "nested more than 32 deep"),
    ],
)
def test_schemas_xgrammar_cannot_enforce_are_refused(llm, schema, problem):
    with pytest.raises(InvalidRequest, match=re.escape(problem)) as failure:
        llm.engine.make_sequence("x", [5, 6], structured(json=schema))
    assert failure.value.field == "structured_outputs.json"


def test_regexes_with_huge_repeats_or_nul_are_refused(llm):
    for regex, problem in [("a{2000}", "repetition bound 2000"), ("a\x00b", "NUL")]:
        with pytest.raises(InvalidRequest, match=problem) as failure:
            llm.engine.make_sequence("x", [5, 6], structured(regex=regex))
        assert failure.value.field == "structured_outputs.regex"


def test_a_dead_end_fails_only_that_request(llm, prompts):
    """min_tokens bans the stop token ids; here the grammar's only possible token is one."""
    x = llm.tokenizer.convert_tokens_to_ids("x")
    dead = SamplingParams(
        temperature=0,
        max_tokens=10,
        min_tokens=3,
        stop_token_ids=[x],
        structured_outputs=StructuredOutputsParams(regex="x"),
    )
    outputs = llm.generate(
        prompts[:3], [structured(regex=REGEXES[1]), dead, structured(choice=CHOICES)], use_tqdm=False
    )
    assert outputs[1].finish_reason == "error" and "min_tokens bans the stop token ids" in outputs[1].error
    assert outputs[1].token_ids == []
    assert re.fullmatch(REGEXES[1], outputs[0].text) and outputs[2].text in CHOICES


# ---------------------------------------------------------------- how structured requests end


def test_a_cut_json_is_length(llm, prompts):
    output = llm.generate(prompts[:1], structured(json=SCHEMAS["nested_object"], max_tokens=6), use_tqdm=False)[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 6
    assert output.text.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_a_complete_grammar_stops_whatever_ignore_eos_and_min_tokens(llm, prompts):
    params = SamplingParams(
        temperature=0,
        max_tokens=50,
        ignore_eos=True,
        min_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    for output in llm.generate(prompts, params, use_tqdm=False):
        assert output.finish_reason == "stop" and output.stop_reason is None and output.text in CHOICES
        assert output.token_ids[-1] in llm.engine.spec.eos_token_ids


def test_stop_strings_still_cut_a_structured_output(llm, prompts):
    params = structured(json=SCHEMAS["numbers"], max_tokens=50)
    params.stop = [":"]  # right after the first key
    output = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    assert (output.finish_reason, output.stop_reason, output.text) == ("stop", ":", '{"ratio"')


# ---------------------------------------------------------------- exact in every scheduling regime


def hf_structured_greedy(model_dir: str, prompt: list[int], max_new_tokens: int, grammar) -> list[int]:
    """transformers' greedy generate with xgrammar's own logits processor (the reference)."""
    model = _load(model_dir)
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar.compiled)],
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def exact_workload(llm, tiny_model):
    """Eight greedy structured requests (prompts of 20-120 tokens) and their reference tokens."""
    prompts = mixed_prompts(768, n=8, seed=9, min_len=20, max_len=120)
    constraints = [dict(json=s) for s in SCHEMAS.values()] + [dict(regex=REGEXES[2]), dict(grammar=GRAMMAR)]
    params = [structured(**c, max_tokens=120) for c in constraints]
    grammars = [llm.engine.inputs.compile_grammar(p) for p in params]
    expected = [hf_structured_greedy(tiny_model, p, 120, g) for p, g in zip(prompts, grammars)]
    return prompts, params, expected


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_structured_outputs_match_transformers(tiny_model, exact_workload, regime):
    prompts, params, expected = exact_workload
    llm = LLM(tiny_model, **REGIMES[regime])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert (output.finish_reason, output.token_ids) == ("stop", want), (output.request_id, output.error)
    stats = llm.engine.stats()
    if regime.endswith("preemption"):
        assert stats["num_preemptions"] > 0
    if regime.endswith("chunked_prefill"):
        assert stats["num_chunked_prefills"] > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


# ---------------------------------------------------------------- the pieces


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(llm, monkeypatch):
    compiler = grammar_compiler.GrammarCompiler(llm.tokenizer, llm.engine.spec.hf_config.vocab_size, {1})
    first = compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    monkeypatch.setattr(grammar_compiler, "MAX_CACHED", 2)
    for regex in ("b+", "c+"):
        compiler.compile(StructuredOutputsParams(regex=regex))
    assert [key[1] for key in compiler.cache] == ["b+", "c+"]
    assert compiler.cached_bytes == sum(g.compiled.memory_size_bytes for g in compiler.cache.values())


def test_length_bounded_strings_hold_no_raw_control_characters(llm):
    """xgrammar 0.2.9 lets them through in strings with minLength/maxLength: we fix its grammar."""
    grammar = llm.engine.inputs.compile_grammar(structured(json={"type": "string", "maxLength": 3}))
    for text, ok in [('"ab"', True), ('"\x0f"', False), ('"\t"', False), ('"\\n"', False), ('"abcd"', False)]:
        matcher = xgr.GrammarMatcher(grammar.compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


def test_params_are_checked_when_the_request_is_accepted(llm):
    cases = [
        (dict(), "structured_outputs: exactly one of"),
        (dict(json_object=False), "json_object: must be true"),
        (dict(choice=["x" * 1025]), "each choice at most 1024"),
        (dict(regex="a" * 70_000), "70000 bytes"),
        (dict(json=5), "must be a JSON schema"),
        (dict(json=[1]), "must be a JSON schema"),
    ]
    for constraint, problem in cases:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
        with pytest.raises(InvalidRequest, match=re.escape(problem)):
            llm.engine.make_sequence("x", [5, 6], params)
    as_dict = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert as_dict.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


@pytest.mark.parametrize(
    "structured_outputs, field, problem",
    [
        ({"regex": "a" * 65_537}, "structured_outputs.regex", "65537 bytes, limit 65536"),
        ({"json": {"description": "x" * 65_536}}, "structured_outputs.json", "bytes, limit 65536"),
        ({"choice": ["x"] * 1025}, "structured_outputs.choice", "at most 1024 items"),
        ({"choice": ["x" * 1025]}, "structured_outputs.choice[0]", "at most 1024 characters"),
        ({"choice": ["x" * 1000] * 70}, "structured_outputs.choice", "70000 bytes in all, limit 65536"),
        ({"regex": "a", "structural_tag": "{}"}, "structured_outputs.structural_tag", "Extra inputs are not permitted"),
        ({"json": {"a": b"bytes"}}, "structured_outputs.json", "must be plain JSON"),
        ({"grammar": "root ::= x", "json_object": True}, "structured_outputs", "exactly one of"),
    ],
)
def test_the_wire_bounds_structured_outputs(structured_outputs, field, problem):
    from conveyor.clients.errors import InvalidJob
    from conveyor.clients.protocol import validate_job

    with pytest.raises(InvalidJob) as failure:
        validate_job({"prompt": "hi", "structured_outputs": structured_outputs})
    assert failure.value.field == field and problem in failure.value.message, failure.value.message


# ---------------------------------------------------------------- over a real replica and the gateway


@pytest.fixture(scope="module")
def replica(tiny_model, redis_url):
    from scratch import scratch_namespace

    with scratch_namespace(redis_url, "structured") as ns:
        with ReplicaThread(
            tiny_model, redis_url, ns, consumer="structured-replica", served_model_name=MODEL, kv_cache_memory="64MiB"
        ):
            wait_until(lambda: redis.Redis.from_url(redis_url).exists(Keys(ns).model_info(MODEL)), 30, "model info")
            yield ns


def test_structured_jobs_over_a_replica_and_a_bad_schema_fails_alone(replica, redis_url, llm, prompts):
    client = Client(redis_url, namespace=replica)
    schema = SCHEMAS["any_of_and_ref"]
    so = {"json": schema, "disable_any_whitespace": True}
    good = client.submit(prompt_token_ids=prompts[0], max_tokens=MAX_TOKENS, temperature=0, structured_outputs=so)
    bad = client.submit(prompt_token_ids=prompts[1], max_tokens=20, structured_outputs={"json": {"type": "foo"}})
    choice = client.submit(
        prompt_token_ids=prompts[2], max_tokens=20, temperature=0.7, seed=4, structured_outputs={"choice": CHOICES}
    )
    result = good.result(timeout=60)
    assert result.finish_reason == "stop"
    assert result.token_ids == llm.generate(prompts[:1], structured(json=schema), use_tqdm=False)[0].token_ids
    validate(result.text, schema)
    with pytest.raises(JobFailed) as failure:
        bad.result(timeout=60)
    assert failure.value.code == "invalid_request"
    assert failure.value.reason.startswith("structured_outputs.json: cannot compile the JSON schema")
    assert choice.result(timeout=60).text in CHOICES
    raw = redis.Redis.from_url(redis_url)  # a producer that only runs XADD, JSON schema as text
    raw.xadd(
        Keys(replica).interactive,
        {
            "json": json.dumps(
                {
                    "job_id": "raw-structured",
                    "prompt": "def main():",
                    "max_tokens": 30,
                    "structured_outputs": {"regex": REGEXES[3]},
                }
            )
        },
    )
    assert re.fullmatch(REGEXES[3], client.job("raw-structured").result(timeout=60).text)


def test_gateway_response_format_with_the_openai_sdk(replica, redis_url):
    with GatewayThread(redis_url, replica) as gateway:
        sdk = openai_client(gateway)
        messages = [{"role": "user", "content": "Where is the point?"}]
        schema = {"name": "point", "schema": POINT, "strict": True}
        # any whitespace (as OpenAI's API): this random model spends most tokens on it
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=300,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": schema},
        )
        assert reply.choices[0].finish_reason == "stop"
        validate(reply.choices[0].message.content, POINT)

        class Answer(pydantic.BaseModel):  # the SDK's own structured-output helper, parsed by pydantic
            label: str = pydantic.Field(max_length=5)
            level: int = pydantic.Field(ge=0, le=3)

        parsed = sdk.chat.completions.parse(
            model=MODEL, messages=messages, max_tokens=300, temperature=0, response_format=Answer
        )
        assert isinstance(parsed.choices[0].message.parsed, Answer)

        completion = sdk.completions.create(
            model=MODEL,
            prompt="Point:",
            max_tokens=300,
            temperature=0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": schema}},
        )  # vLLM takes it here too
        assert completion.choices[0].finish_reason == "stop"
        validate(completion.choices[0].text, POINT)
        choice = sdk.completions.create(
            model=MODEL, prompt="Mood:", max_tokens=20, extra_body={"structured_outputs": {"choice": CHOICES}}
        )
        assert choice.choices[0].text in CHOICES
        with pytest.raises(openai.BadRequestError) as failure:
            sdk.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=5,
                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "foo"}}},
            )
        assert "cannot compile the JSON schema" in failure.value.message
        with pytest.raises(openai.BadRequestError) as failure:
            sdk.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=5,
                response_format={"type": "json_schema", "json_schema": {"name": "none"}},
            )
        assert failure.value.param == "response_format.json_schema.schema"


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_writes_valid_json():
    llm = LLM("smollm2", dtype="float32", device="cpu", kv_cache_memory="128MiB", quantization="gguf")
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    }
    chats = [
        [{"role": "user", "content": "Describe a French programmer as JSON."}],
        [{"role": "user", "content": "Give the x and y of a point as JSON."}],
        [{"role": "user", "content": "Describe a German teacher as JSON."}],
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=person)),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=POINT)),
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(json=person)),
    ]
    outputs = [llm.chat(chat, p, use_tqdm=False)[0] for chat, p in zip(chats, params)]
    assert [o.finish_reason for o in outputs] == ["stop", "stop", "length"], [o.text for o in outputs]
    validate(outputs[0].text, person)
    validate(outputs[1].text, POINT)
    assert outputs[2].text.startswith("{")
