"""The Llama family on paged attention: Llama 2/3 (incl. llama3 rope scaling), SmolLM2,
Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), and its mixture-of-experts
members Mixtral, Qwen2-MoE and Qwen3-MoE (engine/models/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.engine.attention_metadata import AttentionMetadata
from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, TiedHead
from conveyor.engine.models.moe import SparseMoe
from conveyor.engine.models.weights import WeightLoader
from conveyor.kernels.layer_ops import silu_and_mul

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FAMILIES = {  # architecture -> (qkv bias rule, per-head q/k norm)
    "LlamaForCausalLM": ("attention_bias", False),
    "MistralForCausalLM": ("none", False),
    "Qwen2ForCausalLM": ("qkv_only", False),
    "Qwen3ForCausalLM": ("attention_bias", True),
    "MixtralForCausalLM": ("none", False),
    "Qwen2MoeForCausalLM": ("qkv_config", False),  # q/k/v bias as config.qkv_bias says (default on)
    "Qwen3MoeForCausalLM": ("attention_bias", True),
}
MOE_FAMILIES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


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
    moe: MoeArch | None = None  # a mixture-of-experts model's experts (None: dense)

    def sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

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
            qkv_bias={
                "attention_bias": attention_bias,
                "none": False,
                "qkv_only": True,
                "qkv_config": bool(getattr(config, "qkv_bias", True)),
            }[bias_rule],
            o_bias=attention_bias and bias_rule == "attention_bias",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            max_positions=max_context(config),
            moe=MoeArch.from_hf(config, architecture) if architecture in MOE_FAMILIES else None,
        )


@dataclass(frozen=True)
class MoeArch:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights scaled to sum 1 (Mixtral always; Qwen: norm_topk_prob)
    shared_intermediate_size: int  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, config, architecture: str) -> "MoeArch":
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
        top_k = config.num_experts_per_tok
        if not 0 < top_k <= experts:
            raise ModelLoadError(f"config: num_experts_per_tok {top_k} must be 1..{experts} (the experts)")
        if architecture == "MixtralForCausalLM":
            return cls(experts, top_k, config.intermediate_size, True, 0, frozenset(range(config.num_hidden_layers)))
        step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", []) or [])
        sparse = frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            experts,
            top_k,
            config.moe_intermediate_size,
            bool(getattr(config, "norm_topk_prob", False)),
            getattr(config, "shared_expert_intermediate_size", 0) if architecture == "Qwen2MoeForCausalLM" else 0,
            sparse,
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
    def __init__(self, arch: LlamaArch, index: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = sparse_moe(arch) if arch.sparse(index) else LlamaMLP(arch)
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


def sparse_moe(arch: LlamaArch) -> SparseMoe:
    moe = arch.moe
    return SparseMoe(
        arch.hidden_size,
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
        moe.renormalize,
        moe.shared_intermediate_size,
    )


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, index) for index in range(arch.num_layers))
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
            **moe_packing(a.moe),  # before gate_proj/up_proj: their names hold those too
            "gate_proj": ("gate_up_proj", 0, inter, _dense),
            "up_proj": ("gate_up_proj", inter, inter, _dense),
        }
        loader = WeightLoader(self, packed, ignored=("rotary_emb.inv_freq",))
        skip_head = a.tie_word_embeddings

        def rename(name: str) -> str | None:
            if skip_head and name.startswith("lm_head"):
                return None
            return moe_name(name) if a.moe is not None else name

        loader.load(weights, rename=rename)
        loader.check_complete()


MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_name(name: str) -> str:
    """A MoE checkpoint name in our modules' terms: Mixtral's ``block_sparse_moe`` and w1/w3/w2
    as ``mlp`` and gate/up/down, and each expert's (and the shared expert's) gate/up given a
    name of its own (their widths differ from a dense layer's: moe_packing)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in MIXTRAL_EXPERT.items():
        name = name.replace(f".{old}.weight", f".{new}.weight") if ".experts." in name else name
    for kind in ("experts", "shared_expert"):
        for part in ("gate_proj", "up_proj"):
            if f".{kind}." in name and f".{part}." in name:
                return name.replace(f".{part}.", f".{kind}_{part}.")
    return name


def moe_packing(moe: MoeArch | None) -> dict[str, tuple[str, int, int]]:
    if moe is None:
        return {}
    inter, shared = moe.intermediate_size, moe.shared_intermediate_size
    return {
        "experts_gate_proj": ("gate_up_proj", 0, inter, _in_experts),
        "experts_up_proj": ("gate_up_proj", inter, inter, _in_experts),
        "shared_expert_gate_proj": ("gate_up_proj", 0, shared, _in_shared_expert),
        "shared_expert_up_proj": ("gate_up_proj", shared, shared, _in_shared_expert),
    }


def _in_experts(name: str) -> bool:
    return ".experts." in name


def _in_shared_expert(name: str) -> bool:
    return ".shared_expert." in name


def _dense(name: str) -> bool:
    return not (_in_experts(name) or _in_shared_expert(name))
