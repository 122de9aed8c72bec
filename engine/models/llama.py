"""The Llama family on paged attention: Llama 2/3 (incl. llama3 rope scaling), SmolLM2,
Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm)."""

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.engine.attention_metadata import AttentionMetadata
from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, TiedHead
from conveyor.engine.models.weights import WeightLoader
from conveyor.kernels.layer_ops import silu_and_mul

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FAMILIES = {  # architecture -> (qkv bias rule, per-head q/k norm)
    "LlamaForCausalLM": ("attention_bias", False),
    "MistralForCausalLM": ("none", False),
    "Qwen2ForCausalLM": ("qkv_only", False),
    "Qwen3ForCausalLM": ("attention_bias", True),
}


@dataclass
class LlamaArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_positions: int

    @classmethod
    def from_hf(cls, config, architecture: str) -> "LlamaArch":
        bias_rule, qk_norm = FAMILIES[architecture]
        _check_supported(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias={"attention_bias": attention_bias, "none": False, "qkv_only": True}[bias_rule],
            o_bias=attention_bias and bias_rule == "attention_bias",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            max_positions=max_context(config),
        )


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def max_context(config) -> int:
    """The longest context the model attends to fully (a sliding window caps it)."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)
    return min(limit, window) if window and uses_window else limit


def _check_supported(config) -> None:
    if config.hidden_act not in ("silu", "swish"):
        raise ModelLoadError(f"config: hidden_act {config.hidden_act!r} unsupported; supported: silu")
    if rope_type(config) not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config: rope type {rope_type(config)!r} unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise ModelLoadError("config: pretraining_tp > 1 unsupported")


def rotary_for(config, architecture: str, max_positions: int) -> RotaryEmbedding:
    """Frequencies as the family's transformers `<Family>RotaryEmbedding` computes them: its
    default formula (the same in all four families), else transformers' ROPE_INIT_FUNCTIONS.
    Importing the family's modeling module instead would pull in transformers' generation
    stack and torch._dynamo: seconds of every replica start (tests/test_model_factory.py
    checks the two agree)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert architecture in FAMILIES, architecture
    kind = config.rope_parameters["rope_type"]
    with torch.device("cpu"):  # real tables even while the model is built on the meta device
        inv_freq, scaling = default_rope(config) if kind == "default" else ROPE_INIT_FUNCTIONS[kind](config)
        return RotaryEmbedding(inv_freq, scaling, max_positions)


def default_rope(config) -> tuple[torch.Tensor, float]:
    """transformers' `compute_default_rope_parameters` of Llama, Mistral, Qwen2 and Qwen3."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class LlamaAttention(nn.Module):
    BF16_OUTPUT_LINEARS = ("o_proj",)  # add_rms_norm reads bf16 (kernels/cpu/linear.py)

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)

    def forward(self, x, cos_sin, meta: AttentionMetadata):
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, meta, cos_sin)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    # silu_and_mul and add_rms_norm read bf16 too (kernels/cpu/linear.py)
    BF16_OUTPUT_LINEARS = ("gate_up_proj", "down_proj")

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, residual, cos_sin, meta):
        """``x`` is the previous layer's output, ``residual`` the stream before it (None at
        the first layer); the adds are folded into the norms."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, architecture: str, max_model_len: int):
        super().__init__()
        self.arch = LlamaArch.from_hf(config, architecture)
        self.model = LlamaModel(self.arch)
        self.rotary = rotary_for(config, architecture, max_model_len)
        self.lm_head = (
            TiedHead(self.model.embed_tokens)
            if self.arch.tie_word_embeddings
            else nn.Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        x, residual = self.model.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        hidden = self.model.norm(x, residual)[0]
        return hidden.to(self.model.norm.weight.dtype)  # a bf16 product's norm is bf16 (BF16_OUTPUT_LINEARS)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        a = self.arch
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        packed = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        loader = WeightLoader(self, packed, ignored=("rotary_emb.inv_freq",))
        skip_head = a.tie_word_embeddings
        loader.load(weights, rename=lambda n: None if skip_head and n.startswith("lm_head") else n)
        loader.check_complete()
