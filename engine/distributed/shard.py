"""Megatron-style shards of a loaded Llama-family model, in place, before the backend packs
its linears: attention heads and the MLP's intermediate columns are split over the ranks
(qkv and gate_up column-parallel, o and down row-parallel, each followed by one
all-reduce), norms, the embedding and the output head stay whole on every rank (a
replicated head: only rank 0 computes logits). Each rank's KV cache holds its own heads.
A mixture-of-experts layer is split by experts instead (expert parallel: _shard_experts)."""

import torch
from torch import nn

from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.moe import SparseMoe


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the input features, summed over the ranks: the
    bias is rank 0's alone, so it is added once."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear = linear  # a plain nn.Linear: the CPU backend swaps it for its own
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def check_shardable(model_class, hf_config, size: int, quantization: str, expert_parallel: bool = False) -> None:
    """ModelLoadError naming what cannot be split ``size`` ways."""
    if model_class is not LlamaForCausalLM:
        raise ModelLoadError(
            f"tensor_parallel_size={size}: only the Llama family (Llama, Mistral, Qwen2, "
            f"Qwen3) can be split; run this model with tensor_parallel_size=1"
        )
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if experts and not expert_parallel:
        raise ModelLoadError(
            f"tensor_parallel_size={size}: a mixture-of-experts model splits its experts over the "
            f"ranks: pass enable_expert_parallel=True (--enable-expert-parallel true)"
        )
    if quantization == "gguf":
        raise ModelLoadError(
            f"tensor_parallel_size={size}: GGUF blocks are not split; use quantization='auto' "
            f"or 'none' (the shards are then dequantized)"
        )
    heads = hf_config.num_attention_heads
    counts = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
    }
    if experts:  # each rank holds whole experts; Qwen2-MoE's shared expert and dense layers are split
        counts["experts"] = experts
        if getattr(hf_config, "model_type", "") != "mixtral":  # Mixtral's intermediate_size is an expert's
            counts["intermediate_size"] = hf_config.intermediate_size
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            counts["shared_expert_intermediate_size"] = hf_config.shared_expert_intermediate_size
    else:
        counts["intermediate_size"] = hf_config.intermediate_size
    for name, count in counts.items():
        if count % size:
            raise ModelLoadError(f"tensor_parallel_size={size}: the model's {name} ({count}) is not a multiple of it")


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, size: int, group) -> None:
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, rank, size, group)
        if isinstance(layer.mlp, SparseMoe):
            _shard_experts(layer.mlp, rank, size, group)
        else:
            _shard_mlp(layer.mlp, rank, size, group)


def _shard_attention(attn, rank: int, size: int, group) -> None:
    head_dim, heads, kv_heads = attn.head_dim, attn.num_heads // size, attn.num_kv_heads // size
    q, kv = heads * head_dim, kv_heads * head_dim
    rows = [
        range(rank * q, (rank + 1) * q),  # this rank's query heads, then its key and value heads
        range(attn.q_size + rank * kv, attn.q_size + (rank + 1) * kv),
        range(attn.q_size + attn.kv_size + rank * kv, attn.q_size + attn.kv_size + (rank + 1) * kv),
    ]
    attn.qkv_proj = _rows(attn.qkv_proj, torch.tensor([i for part in rows for i in part]))
    attn.o_proj = RowParallelLinear(_columns(attn.o_proj, rank * q, q, rank), group)
    attn.q_size, attn.kv_size, attn.num_heads, attn.num_kv_heads = q, kv, heads, kv_heads
    attn.attn.num_heads, attn.attn.num_kv_heads = heads, kv_heads


def _shard_mlp(mlp, rank: int, size: int, group, reduce: bool = True) -> None:
    """This rank's intermediate columns; ``reduce``: its down projection sums over the ranks
    (else its output is this rank's part, summed by whoever reads it)."""
    inter = mlp.down_proj.in_features
    part = inter // size
    gate_up = torch.cat(
        [torch.arange(rank * part, (rank + 1) * part), torch.arange(inter + rank * part, inter + (rank + 1) * part)]
    )
    mlp.gate_up_proj = _rows(mlp.gate_up_proj, gate_up)
    down = _columns(mlp.down_proj, rank * part, part, rank)
    mlp.down_proj = RowParallelLinear(down, group) if reduce else down


def _shard_experts(moe: SparseMoe, rank: int, size: int, group) -> None:
    """Expert parallel: this rank keeps experts [rank * E/N, (rank + 1) * E/N) whole, every rank
    routes every token (the hidden states are the same on all), and the layer's output is its
    experts' part (and its part of a shared expert) summed over the ranks in one all-reduce."""
    per_rank = moe.num_experts // size
    moe.first_expert = rank * per_rank
    moe.experts = nn.ModuleList(list(moe.experts)[rank * per_rank : (rank + 1) * per_rank])
    if moe.shared_expert is not None:
        _shard_mlp(moe.shared_expert, rank, size, group, reduce=False)
    moe.group = group


def _rows(linear: nn.Linear, index: torch.Tensor) -> nn.Linear:
    """Column-parallel: the output features ``index`` (and their bias)."""
    index = index.to(linear.weight.device)
    bias = linear.bias.index_select(0, index) if linear.bias is not None else None
    return _linear(linear.weight.index_select(0, index), bias)


def _columns(linear: nn.Linear, start: int, count: int, rank: int) -> nn.Linear:
    """Row-parallel: the input features ``start:start+count``; the bias on rank 0 only."""
    bias = linear.bias.clone() if linear.bias is not None and rank == 0 else None
    return _linear(linear.weight[:, start : start + count].contiguous(), bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear
