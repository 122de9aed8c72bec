"""Bad requests fail alone (finish_reason 'error', a message naming the field and the limit)
while the rest of the batch runs; unservable models fail at construction with ModelLoadError;
aborts end one request and leave the others alone."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_factory, however pytest is run

from model_factory import VOCAB_SIZE, build_tiny_model, build_tokenizer, hf_greedy, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, InvalidRequest, ModelLoadError, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 64
KV = "64MiB"  # KV cache pool per engine: plenty for the tiny model, far below the 1 GiB default


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("bad_input_llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_memory=KV, max_model_len=MAX_MODEL_LEN, seed=0)


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids(n: int, seed: int) -> list[int]:
    return mixed_prompts(VOCAB_SIZE, n=3, seed=seed, min_len=n, max_len=n)[0]


# --------------------------------------------------------------------------- one mixed batch

# (prompt, params, fragments the error must contain: the field first, then the limit/value)
BAD = [
    ("", greedy(), ["prompt", "empty"]),
    ([], greedy(), ["prompt_token_ids", "empty"]),
    (ids(5, 1), greedy(max_tokens=0), ["max_tokens", ">= 1", "0"]),
    (ids(5, 2), greedy(max_tokens=-1), ["max_tokens", ">= 1", "-1"]),
    (ids(5, 3), greedy(max_tokens=2.5), ["max_tokens", "integer"]),
    (ids(5, 4), SamplingParams(temperature=float("nan")), ["temperature", "finite", "nan"]),
    (ids(5, 5), SamplingParams(temperature=float("inf")), ["temperature", "finite"]),
    (ids(5, 6), SamplingParams(temperature=-0.5), ["temperature", ">= 0", "-0.5"]),
    (ids(5, 7), SamplingParams(temperature="hot"), ["temperature", "number"]),
    (ids(5, 8), SamplingParams(top_p=0), ["top_p", "> 0"]),
    (ids(5, 9), SamplingParams(top_p=1.5), ["top_p", "<= 1", "1.5"]),
    (ids(5, 10), SamplingParams(top_k=-2), ["top_k", ">= 0", "-2"]),
    (ids(5, 11), SamplingParams(min_p=1.5), ["min_p", "<= 1"]),
    (ids(5, 12), SamplingParams(repetition_penalty=0.0), ["repetition_penalty", ">= 0.01"]),
    (ids(5, 13), SamplingParams(presence_penalty=2.5), ["presence_penalty", "<= 2"]),
    (ids(5, 14), SamplingParams(frequency_penalty=-3.0), ["frequency_penalty", ">= -2"]),
    (ids(5, 15), SamplingParams(seed=-1), ["seed", ">= 0"]),
    (ids(5, 16), SamplingParams(logprobs=21), ["logprobs", "<= 20"]),
    (ids(5, 17), SamplingParams(max_tokens=3, min_tokens=5), ["min_tokens", "max_tokens", "3"]),
    (ids(5, 18), SamplingParams(stop=[""]), ["stop", "non-empty"]),
    (ids(5, 23), SamplingParams(temperature=1e308, min_tokens=2), ["temperature", "<= 100.0"]),  # no fp32 overflow
    (ids(5, 24), SamplingParams(stop=["x" * 1000] * 5), ["stop", "4096", "5000"]),
    (ids(5, 25), SamplingParams(stop=[f"s{i}" for i in range(33)]), ["stop", "32", "33"]),
    (ids(5, 26), SamplingParams(stop=["y" * 1025]), ["stop", "1024", "1025"]),
    (ids(5, 19), SamplingParams(stop_token_ids=[VOCAB_SIZE]), ["stop_token_ids", str(VOCAB_SIZE - 1)]),
    (ids(70, 20), greedy(), ["prompt", "max_model_len", "70", str(MAX_MODEL_LEN)]),  # prompt alone too long
    (ids(50, 21), greedy(max_tokens=20), ["prompt", "max_model_len", "50", "20", str(MAX_MODEL_LEN)]),
    (ids(MAX_MODEL_LEN, 22), greedy(max_tokens=None), ["prompt", "max_model_len", str(MAX_MODEL_LEN)]),
    ([5, 6, VOCAB_SIZE], greedy(), ["prompt_token_ids", str(VOCAB_SIZE), "768"]),
    ([5, -1, 6], greedy(), ["prompt_token_ids", "-1"]),
    ([5, 6.0, 7], greedy(), ["prompt_token_ids", "6.0"]),
    (None, greedy(), ["prompt", "NoneType"]),
]

# (prompt, params, expected number of output tokens)
GOOD = [
    (ids(10, 30), greedy(8), 8),
    ("def foo(x):\n    return x", greedy(6), 6),
    (ids(56, 31), greedy(8), 8),  # exactly max_model_len
    (ids(60, 32), greedy(None), MAX_MODEL_LEN - 60),  # max_tokens=None: up to max_model_len
    (ids(1, 33), SamplingParams(temperature=0.0, top_p=1e-9, min_p=1.0, max_tokens=5, ignore_eos=True), 5),
]


def test_bad_requests_fail_alone_in_one_batch(llm, model_dir):
    # interleave: good ones at the start, the end and in between
    plan = (
        [("good", GOOD[0])]
        + [("bad", b) for b in BAD[:10]]
        + [("good", GOOD[1])]
        + [("bad", b) for b in BAD[10:20]]
        + [("good", GOOD[2]), ("good", GOOD[3])]
        + [("bad", b) for b in BAD[20:]]
        + [("good", GOOD[4])]
    )
    prompts = [case[0] for _, case in plan]
    params = [case[1] for _, case in plan]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(plan)
    for (kind, case), out in zip(plan, outs):
        prompt, _, expectation = case
        assert out.finished, case
        if kind == "bad":
            assert out.finish_reason == "error", case
            assert out.error, case
            assert out.error.startswith(expectation[0] + ":"), (out.error, expectation)
            for fragment in expectation:
                assert fragment in out.error, (out.error, fragment)
            assert out.token_ids == [] and out.text == ""
        else:
            assert out.error is None, out.error
            assert out.finish_reason == "length"
            if isinstance(prompt, str):
                assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
            else:
                assert out.prompt_token_ids == prompt  # outputs come back in prompt order
            assert len(out.token_ids) == expectation
            assert out.token_ids == hf_greedy(model_dir, out.prompt_token_ids, expectation, ignore_eos=True)
    assert not llm.engine.has_unfinished_requests()


def test_add_request_raises_invalid_request_and_keeps_no_state(llm):
    engine = llm.engine
    free = engine.scheduler.block_manager.num_free_blocks
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad-temperature", [5, 6, 7], SamplingParams(temperature=-1))
    assert info.value.field == "temperature" and "-1" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad-priority", [5, 6, 7], greedy(), priority_class="urgent")
    assert info.value.field == "priority_class" and "interactive" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("too-long", ids(65, 40), greedy(1))
    assert info.value.field == "prompt" and str(MAX_MODEL_LEN) in str(info.value)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_free_blocks == free
    # the same ids are free to use afterwards
    engine.add_request("bad-temperature", [5, 6, 7], greedy(2))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outs] == [("bad-temperature", "length", 2)]


def test_bad_chat_messages_fail_alone(llm, model_dir):
    good = [{"role": "user", "content": "def f():"}]
    conversations = [good, [{"role": "user"}], [{"role": 1, "content": "x"}], ["not a dict"], good]
    outs = llm.chat(conversations, greedy(5), use_tqdm=False)
    expected_ids = llm.tokenizer.apply_chat_template(good, add_generation_prompt=True, tokenize=True, return_dict=False)
    for index in (0, 4):
        assert outs[index].finish_reason == "length" and outs[index].error is None
        assert outs[index].prompt_token_ids == list(expected_ids)
        assert outs[index].token_ids == hf_greedy(model_dir, list(expected_ids), 5, ignore_eos=True)
    assert outs[1].finish_reason == "error" and outs[1].error.startswith("messages[0]")
    assert outs[2].finish_reason == "error" and outs[2].error.startswith("messages[0]")
    assert outs[3].finish_reason == "error" and outs[3].error.startswith("messages[0]")


# --------------------------------------------------------------------------- unservable models


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})


def _save_foreign(path: Path, config_cls_name: str) -> None:
    import transformers

    cls = getattr(transformers, config_cls_name)
    cls(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(str(path))
    build_tokenizer(path)


SUPPORTED_NAMES = ["Llama", "Mistral", "Qwen2", "Qwen3", "GPT-2"]

# (name, how to break a copy of the good model dir, extra LLM options, fragments of the message)
BROKEN = [
    (
        "unknown architecture bert",
        lambda d: (shutil.rmtree(d), d.mkdir(), _save_foreign(d, "BertConfig")),
        {},
        ["'bert'", "not supported", *SUPPORTED_NAMES],
    ),
    (
        "unknown architecture gpt_neox",
        lambda d: (shutil.rmtree(d), d.mkdir(), _save_foreign(d, "GPTNeoXConfig")),
        {},
        ["'gpt_neox'", "not supported", *SUPPORTED_NAMES],
    ),
    (
        "rope dynamic",
        lambda d: _edit_config(d, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        {},
        ["rope", "'dynamic'", "llama3", "yarn"],
    ),
    (
        "rope longrope",
        lambda d: _edit_config(
            d,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 256,
            },
        ),
        {},
        ["rope", "'longrope'", "llama3"],
    ),
    ("hidden_act", lambda d: _edit_config(d, hidden_act="gelu"), {}, ["hidden_act", "'gelu'", "silu"]),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), {}, ["safetensors", str("{dir}")]),
    ("wrong shape", lambda d: _edit_config(d, intermediate_size=128), {}, ["shape", "160", "128"]),
    ("missing layer", lambda d: _edit_config(d, num_hidden_layers=3), {}, ["lacks", "layers.2"]),
    ("max_model_len", lambda d: None, {"max_model_len": 4096}, ["max_model_len", "1024", "4096"]),
]

LOADER_FAULTS = [  # once loader bugs: a fused weight missing a part, unchecked shapes, raw errors
    ("missing k_proj", lambda d: _drop_tensor(d, "model.layers.0.self_attn.k_proj.weight"), {}, ["k_proj"]),
    ("missing up_proj", lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"), {}, ["up_proj"]),
    ("kv heads mismatch", lambda d: _edit_config(d, num_key_value_heads=4), {}, ["k_proj", "shape"]),
    ("corrupt config.json", lambda d: (d / "config.json").write_text("{not json"), {}, ["config"]),
    (
        "truncated weights",
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
        {},
        ["safetensors"],
    ),
]


@pytest.mark.parametrize(
    "name, breaker, options, fragments", [pytest.param(*case, id=case[0]) for case in BROKEN + LOADER_FAULTS]
)
def test_unservable_model_raises_model_load_error(model_dir, tmp_path, name, breaker, options, fragments):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    breaker(broken)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(broken), **options)
    message = str(info.value)
    for fragment in fragments:
        assert fragment.replace("{dir}", str(broken)) in message, (message, fragment)


def test_unknown_model_path_raises_model_load_error(tmp_path):
    missing = tmp_path / "nonexistent" / "model"
    with pytest.raises(ModelLoadError) as info:
        LLM(str(missing))
    message = str(info.value)
    assert str(missing) in message and "config.json" in message and ".gguf" in message
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path))  # an existing directory that holds no model


# --------------------------------------------------------------------------- abort


def _drain(engine, outputs: dict, finals: dict) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, f"{out.request_id} reported after it finished"
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out


def test_abort_running_request_others_continue(model_dir):
    llm = LLM(model_dir, kv_cache_memory=KV, seed=0)
    engine = llm.engine
    prompts = {f"r{i}": ids(8 + 5 * i, 50 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(20))
    streamed, finals = {}, {}
    while len(streamed.get("r1", [])) < 3:
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.abort_request("r1")
    _drain(engine, streamed, finals)

    aborted = finals["r1"]
    assert aborted.finished and aborted.finish_reason == "abort"
    reference = hf_greedy(model_dir, prompts["r1"], 20, ignore_eos=True)
    assert 3 <= len(aborted.token_ids) < 20
    assert aborted.token_ids == reference[: len(aborted.token_ids)] == streamed["r1"]
    for request_id in ("r0", "r2", "r3"):
        out = finals[request_id]
        assert out.finish_reason == "length"
        assert out.token_ids == streamed[request_id] == hf_greedy(model_dir, prompts[request_id], 20, ignore_eos=True)
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # the aborted one's blocks came back


def test_abort_waiting_and_mid_prefill_requests(model_dir):
    # one sequence at a time, 16-token steps: a 50-token prompt takes 4 steps to prefill
    llm = LLM(model_dir, kv_cache_memory=KV, max_num_seqs=1, max_num_batched_tokens=16, seed=0)
    engine = llm.engine
    long_prompt, short = ids(50, 60), ids(6, 61)
    engine.add_request("long", long_prompt, greedy(5))
    engine.add_request("queued", short, greedy(5))
    engine.add_request("never-run", short, greedy(5))
    engine.abort_request("never-run")  # before any step
    engine.abort_request("no-such-id")  # unknown: a no-op
    first = engine.step()  # the first 16-token prefill chunk of "long"
    assert {o.request_id for o in first} == {"never-run"}
    assert first[0].finish_reason == "abort" and first[0].token_ids == []
    engine.abort_request("long")  # mid-prefill
    streamed, finals = {}, {}
    _drain(engine, streamed, finals)
    assert finals["long"].finish_reason == "abort" and finals["long"].token_ids == []
    assert finals["queued"].finish_reason == "length"
    assert finals["queued"].token_ids == hf_greedy(model_dir, short, 5, ignore_eos=True)
    engine.abort_request("queued")  # already finished: a no-op, nothing more to report
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_request_id_reused_after_abort(model_dir):
    llm = LLM(model_dir, kv_cache_memory=KV, seed=0)
    engine = llm.engine
    engine.add_request("x", ids(6, 70), greedy(5))
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", ids(7, 71), greedy(5))
    finals = []
    while engine.has_unfinished_requests():
        finals += [(o.finish_reason, o.token_ids) for o in engine.step() if o.finished]
    assert finals[0][0] == "abort"
    assert finals[1] == ("length", hf_greedy(model_dir, ids(7, 71), 5, ignore_eos=True))
