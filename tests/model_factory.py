"""Offline tiny models for exactness tests against transformers' own greedy `generate`.

Everything is built locally: a byte-level BPE tokenizer trained on Python stdlib sources,
and small randomly initialised transformers models saved with `save_pretrained`.

The random weights are made "decisive" on purpose: the default init (std 0.02, norms at 1,
biases at 0) gives near-flat logits, where greedy argmax hinges on ~1e-6 margins and flips
under harmless float reordering. We init with a larger std and then perturb the norm
weights and biases, which also makes them non-trivial so that an engine that drops a bias
or a norm weight is caught.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The BPE trainer gives special tokens the first ids, in this order: 0..4.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
VOCAB_SIZE = 768
MAX_POSITIONS = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Weight init: see the module docstring. Chosen empirically (tests/test_model_factory.py).
INIT_STD = 0.3
NORM_JITTER = 0.2
BIAS_STD = 0.1

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gpt2")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")  # mixtures of experts (tests/test_moe.py)


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=1)
def _trained_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE once per process (deterministic: fixed corpus order)."""
    corpus = [Path(inspect.__file__).read_text(), Path(argparse.__file__).read_text()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def build_tokenizer(out_dir) -> PreTrainedTokenizerFast:
    """Save the tiny tokenizer to `out_dir` (loadable offline by AutoTokenizer) and return it."""
    tokenizer = _trained_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# --------------------------------------------------------------------------- models


def _config(arch: str, tokenizer: PreTrainedTokenizerFast, overrides: dict):
    """The tiny config for `arch`, with `overrides` applied on top."""
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=INIT_STD,
    )
    common = dict(
        ids,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**{**common, **overrides}), LlamaForCausalLM
    if arch == "llama3":
        # head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, 199, ... With original_max 64 and
        # factors (1, 4), pair 0 is kept (< 16), pairs 1-2 are smoothed and pairs 3+ divided by 8.
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        cfg = dict(common, tie_word_embeddings=True, rope_parameters=rope)
        return LlamaConfig(**{**cfg, **overrides}), LlamaForCausalLM
    if arch == "mistral":
        # 3 layers so its weights differ from "llama" (the architectures are the same).
        cfg = dict(common, num_hidden_layers=3, sliding_window=None)
        return MistralConfig(**{**cfg, **overrides}), MistralForCausalLM
    if arch == "qwen2":
        cfg = dict(common, tie_word_embeddings=True)
        return Qwen2Config(**{**cfg, **overrides}), Qwen2ForCausalLM
    if arch == "qwen3":
        cfg = dict(common, head_dim=32)
        return Qwen3Config(**{**cfg, **overrides}), Qwen3ForCausalLM
    if arch in MOE_ARCHS:
        return _moe_config(arch, common, overrides)
    if arch == "gpt2":
        cfg = dict(ids, n_embd=64, n_layer=2, n_head=4, n_inner=160, n_positions=MAX_POSITIONS)
        return GPT2Config(**{**cfg, **overrides}), GPT2LMHeadModel
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _moe_config(arch: str, common: dict, overrides: dict):
    """4 experts, 2 per token, on the dense tiny shapes; Qwen2-MoE with its shared expert and
    its q/k/v bias, Qwen3-MoE with norm_topk_prob as its real checkpoints set it, and one
    dense layer (mlp_only_layers) where the family has them."""
    moe = dict(common, num_experts_per_tok=2)
    if arch == "mixtral":
        cfg = dict(moe, num_local_experts=4, intermediate_size=96, sliding_window=None)
        return MixtralConfig(**{**cfg, **overrides}), MixtralForCausalLM
    qwen = dict(moe, num_experts=4, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "qwen2_moe":
        cfg = dict(qwen, shared_expert_intermediate_size=80, num_hidden_layers=3, use_sliding_window=False)
        return Qwen2MoeConfig(**{**cfg, **overrides}), Qwen2MoeForCausalLM
    cfg = dict(qwen, head_dim=32, norm_topk_prob=True)
    return Qwen3MoeConfig(**{**cfg, **overrides}), Qwen3MoeForCausalLM


@torch.no_grad()
def _perturb_defaults(model: torch.nn.Module) -> None:
    """Make norm weights (init all-ones) and biases (init all-zeros) non-trivial."""
    for param in model.parameters():
        if torch.all(param == 1):
            param.add_(torch.randn_like(param) * NORM_JITTER)
        elif torch.all(param == 0):
            param.normal_(0.0, BIAS_STD)


def build_tiny_model(arch: str, out_dir, seed: int = 0, **overrides) -> str:
    """Build, save (safetensors, float32, with tokenizer) and return the dir of a tiny random model."""
    out_dir = str(out_dir)
    tokenizer = build_tokenizer(out_dir)
    config, model_cls = _config(arch, tokenizer, overrides)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _perturb_defaults(model)
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------- reference


@functools.lru_cache(maxsize=None)
def _load(model_dir: str):
    """Load a saved model once per directory (float32, CPU, eval); don't rebuild into a used dir."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy `generate` on one unpadded prompt; returns only the new token ids."""
    model = _load(str(model_dir))
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    # An explicit None overrides the saved generation_config's EOS. (min_new_tokens would instead
    # mask EOS out of the logits and change which token greedy picks.)
    extra = {"eos_token_id": None} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **extra,
        )
    return out[0, len(prompt_ids) :].tolist()


# --------------------------------------------------------------------------- workloads


def mixed_prompts(
    tokenizer_or_vocab_size, n: int = 12, seed: int = 0, min_len: int = 1, max_len: int = 200
) -> list[list[int]]:
    """`n` deterministic random prompts without special ids; lengths include min_len and max_len."""
    if isinstance(tokenizer_or_vocab_size, int):
        vocab, special = tokenizer_or_vocab_size, set(range(len(SPECIAL_TOKENS)))
    else:
        vocab, special = len(tokenizer_or_vocab_size), set(tokenizer_or_vocab_size.all_special_ids)
    allowed = [i for i in range(vocab) if i not in special]
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(n - 2)]
    return [[rng.choice(allowed) for _ in range(length)] for length in lengths[:n]]


def mixed_max_tokens(n: int = 12, seed: int = 0, low: int = 1, high: int = 40) -> list[int]:
    """`n` deterministic per-prompt max_new_tokens in [low, high], including both ends."""
    rng = random.Random(seed + 1)
    return ([low, high] + [rng.randint(low, high) for _ in range(n - 2)])[:n]
