"""GPT-2 on paged attention: learned positions, LayerNorm, fused c_attn (Conv1D weights)."""

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention_metadata import AttentionMetadata
from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.layers import PagedAttention, TiedHead
from conveyor.engine.models.weights import WeightLoader

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}
UNSUPPORTED_FLAGS = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")


def _check_supported(config) -> None:
    if config.activation_function not in ACTIVATIONS:
        raise ModelLoadError(
            f"config: activation_function {config.activation_function!r} unsupported; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    for flag in UNSUPPORTED_FLAGS:
        if getattr(config, flag, False):
            raise ModelLoadError(f"config: {flag}=True is unsupported for GPT-2")


class GPT2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.hidden // self.num_heads
        self.c_attn = nn.Linear(self.hidden, 3 * self.hidden)
        self.c_proj = nn.Linear(self.hidden, self.hidden)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x, meta: AttentionMetadata):
        tokens = x.shape[0]
        q, k, v = (t.reshape(tokens, self.num_heads, self.head_dim) for t in self.c_attn(x).split(self.hidden, dim=-1))
        return self.c_proj(self.attn(q, k, v, meta).reshape(tokens, self.hidden))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x, meta):
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config, architecture: str, max_model_len: int):
        super().__init__()
        _check_supported(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = (
            TiedHead(self.wte) if self.tie_word_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        # HF GPT-2 stores Conv1D weights as [in, out]; nn.Linear wants [out, in]
        loader = WeightLoader(
            self,
            transposed=("c_attn.weight", "c_proj.weight", "c_fc.weight"),
            ignored=(".attn.bias", ".attn.masked_bias"),
        )
        loader.load(weights, rename=self._rename)
        loader.check_complete()

    def _rename(self, name: str) -> str | None:
        name = name.removeprefix("transformer.")
        if name.startswith("lm_head") and self.tie_word_embeddings:
            return None
        return name
