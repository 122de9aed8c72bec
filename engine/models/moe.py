"""Mixture-of-experts feed-forward blocks of the Llama family's MoE members: Mixtral,
Qwen2-MoE (with its sigmoid-gated shared expert) and Qwen3-MoE.

Routing as transformers does it in all three: a softmax in float32 over every expert's
router logit, the top-k of those probabilities, renormalized to sum 1 where the family
says so (Mixtral always, Qwen with ``norm_topk_prob``). A step's tokens are grouped by
expert, so each active expert runs one GEMM over its tokens (not a loop over tokens), and
the weighted outputs are added back in ascending expert order, as transformers' eager path
adds them (tests/test_moe.py: greedy ids equal transformers' in float32).

Each expert is an ``nn.Linear`` pair (gate/up fused, then down), so the CPU backend packs
and runs them like any dense projection (kernels/cpu/linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.layer_ops import fused_moe_ready, silu_and_mul
from conveyor.kernels.moe import slots_by_expert


class ExpertMLP(nn.Module):
    """One expert: SiLU-gated feed-forward of width ``intermediate_size``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoe(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ):
        super().__init__()
        self.top_k, self.renormalize, self.num_experts = top_k, renormalize, num_experts
        self.first_expert = 0  # experts[i] is expert first_expert + i (expert parallel: a rank's share)
        self.group = None  # expert parallel: the ranks this layer's partial outputs are summed over
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_expert = None
        if shared_intermediate_size:  # Qwen2-MoE: every token also goes through it, gated by a sigmoid
            self.shared_expert = ExpertMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = self.fused_experts(x, weights, chosen) if fused_moe_ready(x) else self._experts(x, weights, chosen)
        if self.shared_expert is not None:  # expert parallel: this rank's part of it
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.group is None else self.group.all_reduce(out)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """One linear pair per expert (this rank's) over its tokens, added back in expert order."""
        out = torch.zeros_like(x)
        tokens, slot_weights, counts = slots_by_expert(weights, chosen, self.num_experts)
        start = sum(counts[: self.first_expert])  # the slots of the experts before this rank's
        for expert, count in zip(self.experts, counts[self.first_expert :]):
            if count:
                rows = tokens[start : start + count]
                out.index_add_(0, rows, expert(x[rows]) * slot_weights[start : start + count, None])
                start += count
        return out

    def fused_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This rank's experts as two grouped GEMMs (kernels/triton/moe.py); other ranks'
        experts' slots get weight 0 (expert parallel)."""
        from conveyor.kernels.triton.moe import fused_experts

        gate_up, down = self.stacked_weights()
        local = chosen - self.first_expert
        elsewhere = (local < 0) | (local >= len(self.experts))
        weights = weights.masked_fill(elsewhere, 0.0)
        return fused_experts(x, gate_up, down, weights, local.masked_fill(elsewhere, 0))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as [E, 2I, H] and [E, H, I], made once; each expert's linears
        then hold views of them (no second copy)."""
        if getattr(self, "_stacked", None) is None:
            gate_up = torch.stack([e.gate_up_proj.weight.detach() for e in self.experts])
            down = torch.stack([e.down_proj.weight.detach() for e in self.experts])
            for index, expert in enumerate(self.experts):
                expert.gate_up_proj.weight = nn.Parameter(gate_up[index], requires_grad=False)
                expert.down_proj.weight = nn.Parameter(down[index], requires_grad=False)
            self._stacked = (gate_up, down)
        return self._stacked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` expert weights (x's dtype) and expert indices."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen
