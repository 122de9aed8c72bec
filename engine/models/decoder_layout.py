"""Our models as the plain DecoderLayout a backend can run whole (kernels/backend.py): the
one place that knows both the model classes and that description."""

from torch import nn

from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.kernels.backend import DecoderLayout


def decoder_layout(model: nn.Module) -> DecoderLayout | None:
    """The Llama family's layout (except Qwen3's per-head q/k norms and mixtures of experts,
    which it lacks); None for any other model. Read once the KV cache is bound (the layout
    holds each layer's cache)."""
    if not isinstance(model, LlamaForCausalLM) or model.arch.qk_norm or model.arch.moe is not None:
        return None
    layers = [
        (
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
            layer.self_attn.attn.k_cache,
            layer.self_attn.attn.v_cache,
        )
        for layer in model.model.layers
    ]
    a, attention = model.arch, model.model.layers[0].self_attn.attn
    return DecoderLayout(
        model.model.embed_tokens,
        model.rotary,
        layers,
        model.model.norm.weight,
        a.rms_norm_eps,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        attention.scale,
    )
