"""Checks of the offline tiny-model factory used by the exactness tests."""

import pytest
import torch
from model_factory import (
    ARCHS,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tokenizer,
    hf_greedy,
    mixed_max_tokens,
    mixed_prompts,
)
from model_factory import _load as load_model
from transformers import AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: build_tiny_model(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


def _manual_greedy(model_dir, prompt, n):
    """Greedy decoding by full re-forward each step: no KV cache, no generate()."""
    model, ids = load_model(str(model_dir)), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_tokenizer_roundtrip_offline(tmp_path):
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert 512 <= len(tok) <= 1000
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == SPECIAL_TOKENS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    text = "def main(argv=None):\n    parser = argparse.ArgumentParser()"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_manual_greedy_and_is_diverse(model_dirs, arch):
    tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    outs = []
    for prompt in mixed_prompts(tok, n=4, max_len=60):
        out = hf_greedy(model_dirs[arch], prompt, 16, ignore_eos=True)
        assert out == _manual_greedy(model_dirs[arch], prompt, 16)
        outs.append(out)
    assert len({tuple(o) for o in outs}) == len(outs)
    assert all(len(set(o)) > 4 for o in outs)


def test_hf_greedy_eos_handling(tmp_path):
    prompt = mixed_prompts(768, n=3)[2]
    full = hf_greedy(build_tiny_model("llama", tmp_path / "a"), prompt, 12, ignore_eos=True)
    # Same weights (the pad id, which shapes init, is unchanged), but EOS is the 5th output token.
    stop_dir = build_tiny_model("llama", tmp_path / "b", eos_token_id=full[4])
    assert full[4] not in full[:4]
    assert hf_greedy(stop_dir, prompt, 12) == full[:5]
    assert hf_greedy(stop_dir, prompt, 12, ignore_eos=True) == full


def test_llama3_rope_scaling_changes_some_frequencies(model_dirs):
    config = load_model(model_dirs["llama3"]).config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    default = 1.0 / (
        config.rope_parameters["rope_theta"] ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    )
    changed = ~torch.isclose(scaled, default)
    assert changed.any() and not changed.all()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt2"])
def test_the_engines_rotary_frequencies_are_the_families_own(model_dirs, arch):
    """engine/models/llama.py computes them without importing the family's modeling module:
    they must stay what that module's RotaryEmbedding computes (default and llama3 rope)."""
    import importlib

    from conveyor.engine.models.layers import RotaryEmbedding
    from conveyor.engine.models.llama import rotary_for

    config = load_model(model_dirs[arch]).config
    (architecture,) = config.architectures
    family = architecture.removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
    theirs = getattr(module, f"{family}RotaryEmbedding")(config)
    ours, expected = (
        rotary_for(config, architecture, 64),
        RotaryEmbedding(theirs.inv_freq, theirs.attention_scaling, 64),
    )
    assert torch.equal(ours.cos, expected.cos) and torch.equal(ours.sin, expected.sin)


def test_mixed_workload_is_deterministic_and_mixed():
    prompts = mixed_prompts(768, n=12, seed=3)
    assert prompts == mixed_prompts(768, n=12, seed=3)
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) == 200 and len(set(lengths)) > 6
    assert all(t >= len(SPECIAL_TOKENS) for p in prompts for t in p)
    max_tokens = mixed_max_tokens(12)
    assert min(max_tokens) == 1 and max(max_tokens) == 40 and len(max_tokens) == 12
