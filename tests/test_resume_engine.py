"""The engine's half of resuming (issue 43): a request carrying the output tokens an earlier
attempt published (EngineCoreRequest.resumed_token_ids) prefills them with its prompt and
ends exactly as the uninterrupted request does: greedy and seeded sampling, penalties,
min_tokens, stop strings and structured outputs keep their meaning."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.detokenizer import IncrementalDetokenizer

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kv_blocks=256) as llm:
        yield llm


def run(llm, request):
    """Add one EngineCoreRequest as the engine core does and step it to its end."""
    engine = llm.llm_engine
    seq = request.to_sequence()
    engine.inputs.adopt_grammar(seq)
    engine.add_sequence(seq)
    final = None
    while final is None:
        for output in engine.step():
            if output.request_id == request.request_id and output.finished:
                final = output
    return final.outputs[0], final


def resumed_after(llm, request, token_ids, request_id: str):
    """``request`` as a new attempt resumes it after ``token_ids`` (with the text readers hold)."""
    carried = tuple(token_ids)
    return dataclasses.replace(
        request, request_id=request_id, resumed_token_ids=carried, resumed_chars=published_chars(llm, request, carried)
    )


def published_chars(llm, request, token_ids) -> int:
    """What readers hold of the text of `token_ids` (the engine's own detokenizer, as it emits)."""
    detok = IncrementalDetokenizer(llm.llm_engine.tokenizer, list(request.prompt_token_ids), list(request.params.stop))
    for token in token_ids:
        detok.add(token)
    detok.take_delta(final=False)
    return detok.emitted


CASES = {
    "greedy": dict(temperature=0, max_tokens=60, ignore_eos=True),
    "seeded sampling": dict(temperature=0.8, seed=1234, max_tokens=60, ignore_eos=True),
    "penalties and min_tokens": dict(
        temperature=0.8,
        seed=7,
        max_tokens=60,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        min_tokens=50,
    ),
    "top-k top-p": dict(temperature=1.0, seed=99, top_k=20, top_p=0.9, max_tokens=48, ignore_eos=True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_ends_as_the_uninterrupted_one(llm, case):
    params = SamplingParams(**CASES[case])
    request = llm.llm_engine.inputs.request_for(f"full-{case}", PROMPT, params)
    full, _ = run(llm, request)
    assert len(full.token_ids) > 20
    for cut in (1, len(full.token_ids) * 2 // 5, len(full.token_ids) - 1):
        resumed = resumed_after(llm, request, full.token_ids[:cut], f"resumed-{case}-{cut}")
        output, whole = run(llm, resumed)
        assert output.token_ids == full.token_ids, (case, cut)
        assert output.text == full.text and output.finish_reason == full.finish_reason
        assert whole.num_output_tokens == len(full.token_ids)


def test_a_resumed_json_job_still_validates_and_stop_strings_hold(llm):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    for params, check in (
        (SamplingParams(temperature=0.9, seed=5, max_tokens=120, structured_outputs={"json": schema}), json.loads),
        (SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, stop=["ab", "c"]), None),
    ):
        request = llm.llm_engine.inputs.request_for("full-structured", PROMPT, params)
        full, _ = run(llm, request)
        cut = max(1, len(full.token_ids) // 2)
        resumed = resumed_after(llm, request, full.token_ids[:cut], "resumed-structured")
        output, _ = run(llm, resumed)
        assert output.token_ids == full.token_ids and output.text == full.text
        if check is not None:
            check(output.text)


def test_a_resumed_request_under_speculation_ends_as_without_it(tiny_model, llm):
    """n-gram speculation over prompt + carried tokens: drafts come from the resumed history
    too, and the verified output is the one the plain engine gives (greedy and seeded)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(tiny_model, num_kv_blocks=256, speculative_config=ngram) as speculative:
        for params in (
            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=3, max_tokens=64, ignore_eos=True),
        ):
            request = llm.llm_engine.inputs.request_for("plain", [5, 6, 5, 6, 5, 6], params)
            plain, _ = run(llm, request)
            cut = len(plain.token_ids) // 2
            resumed = resumed_after(llm, request, plain.token_ids[:cut], "speculative-resumed")
            output, _ = run(speculative, resumed)
            assert output.token_ids == plain.token_ids and output.text == plain.text
