"""The torch reference of a mixture-of-experts layer's experts over stacked weights (what
kernels/triton/moe.py fuses): each expert's tokens in one GEMM, the weighted outputs added
back in ascending expert order, as engine/models/moe.py does with per-expert linears."""

import torch
import torch.nn.functional as F


def slots_by_expert(weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """A step's (token, choice) slots grouped by expert, in ascending expert order: each
    slot's token row and routing weight, and how many slots each expert has."""
    top_k = expert_ids.shape[1]
    slots = expert_ids.reshape(-1)  # slot j belongs to token j // top_k
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=num_experts).tolist()
    return order // top_k, weights.reshape(-1)[order], counts


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    """``x`` [T, H]; ``gate_up`` [E, 2I, H] (gate rows first); ``down`` [E, H, I]; routing
    weights and expert ids [T, k]. Float32 arithmetic, the result in x's dtype."""
    tokens, weights, counts = slots_by_expert(routing_weights.float(), expert_ids, gate_up.shape[0])
    out, start = torch.zeros(x.shape, dtype=torch.float32, device=x.device), 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            gate, up = F.linear(x[rows].float(), gate_up[expert].float()).chunk(2, dim=-1)
            product = F.linear(F.silu(gate) * up, down[expert].float())
            out.index_add_(0, rows, product * weights[start : start + count, None])
            start += count
    return out.to(x.dtype)
