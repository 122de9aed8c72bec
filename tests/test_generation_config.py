"""The model's generation_config.json as the default of a request's unset sampling fields
(vLLM's `generation_config`: auto, vllm or a folder), offline, through the queue and the gateway."""

import json

import httpx
import msgpack
import pytest
from gateway_harness import GatewayThread
from model_factory import build_tiny_model
from replica_harness import ReplicaThread

from conveyor.clients import Client
from conveyor.clients.protocol import JobRequest, decode_job, encode_job, payload_digest
from conveyor.engine import LLM, EngineConfig, ModelLoadError, SamplingParams
from conveyor.engine.config import DEFAULT_MODEL
from conveyor.engine.models.loader import sampling_defaults
from conveyor.engine.sampling_params import SamplingDefaults

ENGINE_OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=64)
PROMPT = [5, 17, 42, 9, 33, 8]
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
GREEDY_STEPS = 6


def write_generation_config(folder, **fields) -> None:
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **fields}))


@pytest.fixture(scope="module")
def sampling_model(tmp_path_factory):
    """A tiny model whose generation config asks for sampling at 0.6, top_p 0.9, ..."""
    folder = tmp_path_factory.mktemp("gen_sampling")
    build_tiny_model("llama", folder)
    write_generation_config(folder, **SAMPLING, max_new_tokens=5)
    return folder


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory):
    """A tiny model whose generation config says temperature 0 (greedy) and 6 new tokens."""
    folder = tmp_path_factory.mktemp("gen_greedy")
    build_tiny_model("llama", folder)
    write_generation_config(folder, temperature=0.0, max_new_tokens=GREEDY_STEPS)
    return folder


# ---------------------------------------------------------------- reading the config


def test_auto_reads_the_sampling_fields_of_generation_config(sampling_model):
    defaults = sampling_defaults(str(sampling_model))
    assert defaults.values == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_tokens": 5,
    }
    assert "temperature=0.6" in defaults.describe() and "generation_config.json" in defaults.describe()


def test_vllm_ignores_it_and_a_folder_or_file_replaces_it(sampling_model, tmp_path):
    assert sampling_defaults(str(sampling_model), "vllm").values == {}
    write_generation_config(tmp_path, temperature=0.3, min_p=0.05, eos_token_id=1)
    assert sampling_defaults(str(sampling_model), str(tmp_path)).values == {"temperature": 0.3, "min_p": 0.05}
    file = tmp_path / "generation_config.json"
    assert sampling_defaults(str(sampling_model), str(file)).values == {"temperature": 0.3, "min_p": 0.05}
    with pytest.raises(ModelLoadError, match="generation_config"):
        sampling_defaults(str(sampling_model), str(tmp_path / "missing"))


def test_a_model_without_sampling_fields_keeps_sampling_params_defaults(tiny_model):
    defaults = sampling_defaults(tiny_model)  # do_sample false, no sampling field: vLLM ignores do_sample
    assert defaults.values == {} and defaults.params() == SamplingParams()
    assert "temperature=1.0" in defaults.describe()


def test_out_of_range_values_are_left_out_never_failing_a_request():
    config = {
        "temperature": -1,
        "top_p": 0.5,
        "top_k": -1,
        "min_p": 3.0,
        "max_new_tokens": 0,
        "repetition_penalty": None,
    }
    defaults = SamplingDefaults.from_generation_config(config, "test")
    assert defaults.values == {"top_p": 0.5, "top_k": 0}
    assert "temperature=-1" in defaults.source and "min_p=3.0" in defaults.source


def test_fill_keeps_what_was_given():
    defaults = SamplingDefaults({"temperature": 0.2, "max_tokens": 7})
    params = {"temperature": 1.0, "max_tokens": 16, "top_p": 1.0}
    assert defaults.fill(params, given={"temperature"}) == {"temperature": 1.0, "max_tokens": 7, "top_p": 1.0}


def test_default_model_is_greedy_where_its_config_says_nothing():
    try:
        defaults = sampling_defaults(DEFAULT_MODEL)
    except ModelLoadError as exc:
        pytest.skip(f"no default model here: {exc}")
    assert defaults.values == {"temperature": 0.0}
    assert sampling_defaults(DEFAULT_MODEL, "vllm").values == {}


def test_engine_config_option_and_its_env(monkeypatch):
    assert EngineConfig().generation_config == "auto"
    monkeypatch.setenv("CONVEYOR_GENERATION_CONFIG", "vllm")
    assert EngineConfig().generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="")


# ---------------------------------------------------------------- offline LLM


def test_offline_default_params_follow_the_model(sampling_model):
    llm = LLM(str(sampling_model), **ENGINE_OPTIONS)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k, default.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert default.max_tokens == 5 and default.min_p == 0.0
    outputs = llm.generate([PROMPT, PROMPT[:3]], use_tqdm=False)  # no params: the model's (max_new_tokens 5)
    assert all(len(out.outputs[0].token_ids) <= 5 for out in outputs)
    ignored = LLM(str(sampling_model), generation_config="vllm", **ENGINE_OPTIONS)
    assert ignored.get_default_sampling_params() == SamplingParams()


def test_offline_generate_without_params_is_greedy_where_the_model_says_so(greedy_model):
    llm = LLM(str(greedy_model), **ENGINE_OPTIONS)
    explicit = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)
    want = llm.generate([PROMPT], explicit, use_tqdm=False)[0].outputs[0].token_ids
    default = llm.get_default_sampling_params()
    default.ignore_eos = True
    assert llm.generate([PROMPT], default, use_tqdm=False)[0].outputs[0].token_ids == want
    assert len(want) == GREEDY_STEPS


# ---------------------------------------------------------------- the queue


def test_unset_sampling_fields_stay_off_the_wire_and_the_digest_does_not_change():
    job = JobRequest(job_id="j", prompt="hi", top_p=0.5)
    payload = msgpack.unpackb(encode_job(job)["data"])
    assert "top_p" in payload and not {"temperature", "max_tokens", "top_k", "min_p", "repetition_penalty"} & set(
        payload
    )
    decoded = decode_job(encode_job(job))
    assert decoded == job and decoded.model_fields_set >= {"top_p"} and "temperature" not in decoded.model_fields_set
    explicit = JobRequest(job_id="j", prompt="hi", top_p=0.5, temperature=1.0, max_tokens=16)
    assert payload_digest(decoded) == payload_digest(job) == payload_digest(explicit)  # defaults filled, as ever
    assert "temperature" in decode_job(encode_job(explicit)).model_fields_set


def test_replica_takes_the_model_defaults_for_what_a_job_leaves_unset(greedy_model, redis_url, namespace):
    with ReplicaThread(str(greedy_model), redis_url, namespace, **ENGINE_OPTIONS):
        client = Client(redis_url, namespace=namespace)
        greedy = client.submit(prompt_token_ids=PROMPT, temperature=0, max_tokens=GREEDY_STEPS, ignore_eos=True)
        unset = client.submit(prompt_token_ids=PROMPT, ignore_eos=True)  # temperature, max_tokens: the model's
        sampled = [
            client.submit(prompt_token_ids=PROMPT, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(4)
        ]
        want = greedy.result(timeout=60).outputs[0].token_ids
        assert len(want) == GREEDY_STEPS
        assert unset.result(timeout=60).outputs[0].token_ids == want
        # a job that sets temperature keeps it (and still takes the model's max_tokens)
        samples = [job.result(timeout=60).outputs[0].token_ids for job in sampled]
        assert all(len(tokens) == GREEDY_STEPS for tokens in samples)
        assert any(tokens != want for tokens in samples)


def test_gateway_requests_that_omit_temperature_get_the_model_defaults(greedy_model, redis_url, namespace):
    name = "greedy-tiny"
    with (
        ReplicaThread(str(greedy_model), redis_url, namespace, served_model_name=name, **ENGINE_OPTIONS),
        GatewayThread(redis_url, namespace) as gateway,
    ):
        body = {"model": name, "prompt": PROMPT, "ignore_eos": True}
        omitted = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=60)
        explicit = httpx.post(
            f"{gateway.base_url}/completions",
            json={**body, "temperature": 0, "max_tokens": GREEDY_STEPS},
            timeout=60,
        )
        assert omitted.status_code == explicit.status_code == 200, omitted.text
        text = omitted.json()["choices"][0]["text"]
        assert text == explicit.json()["choices"][0]["text"]
        assert omitted.json()["usage"]["completion_tokens"] == GREEDY_STEPS
