"""The resident adapters of one model: ``max_loras`` slots, filled from disk on first use and
reused least-recently-used first; before each forward, which rows use which slot.

Llama family only (engine/models/llama.py): the decoder's qkv, o, gate_up and down
projections of every layer are wrapped; embeddings and the LM head are not. On a mixture of
experts (Mixtral, Qwen-MoE) only the attention's qkv and o are: its experts take no adapter."""

from collections import OrderedDict

import torch

from conveyor.engine.lora.adapter import ATTENTION_TARGETS, TARGETS, check_adapter, read_adapter
from conveyor.engine.lora.layers import LoRABatch, LoRALinear
from conveyor.engine.lora.request import LoRARequest
from conveyor.engine.models.llama import LlamaForCausalLM


class LoRAManager:
    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"enable_lora: adapters are served for the Llama family only, not {type(model).__name__}")
        self.targets = TARGETS if model.arch.moe is None else ATTENTION_TARGETS  # what adapters may target
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.batch = LoRABatch()
        self.layers = [self._wrap(model.arch, layer) for layer in model.model.layers]
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.loads = 0  # adapters read from disk so far

    def _wrap(self, arch, layer) -> dict[str, LoRALinear]:
        q, kv, inter, hidden = (
            arch.num_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
            arch.intermediate_size,
            arch.hidden_size,
        )
        attn, mlp = layer.self_attn, layer.mlp
        wrapped = {
            "qkv": (attn, "qkv_proj", [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], hidden),
            "o": (attn, "o_proj", [("o_proj", 0, hidden)], q),
            "gate_up": (mlp, "gate_up_proj", [("gate_proj", 0, inter), ("up_proj", inter, inter)], hidden),
            "down": (mlp, "down_proj", [("down_proj", 0, hidden)], inter),
        }
        if self.targets == ATTENTION_TARGETS:
            del wrapped["gate_up"], wrapped["down"]
        out = {}
        for key, (owner, name, parts, in_features) in wrapped.items():
            lora = LoRALinear(
                getattr(owner, name),
                parts,
                in_features,
                self.max_loras,
                self.max_rank,
                self.batch,
                self.dtype,
                self.device,
            )
            setattr(owner, name, lora)
            out[key] = lora
        return out

    def set_batch(self, row_loras: list[LoRARequest | None]) -> bool:
        """Make this step's adapters resident and cut its rows into runs of one slot; True when any row has one."""
        wanted = {request.lora_int_id: request for request in row_loras if request is not None}
        assert len(wanted) <= self.max_loras, "the scheduler admits at most max_loras adapters at once"
        slot_of = {lora_id: self._resident(request, wanted) for lora_id, request in wanted.items()}
        slots = [None if r is None else slot_of[r.lora_int_id] for r in row_loras]
        self.batch.runs = _runs(slots)
        return bool(wanted)

    def _resident(self, request: LoRARequest, keep: dict) -> int:
        if request.lora_int_id in self.slots:
            self.slots.move_to_end(request.lora_int_id)
            return self.slots[request.lora_int_id]
        slot = self._free_slot(keep)
        self._load(slot, request)
        self.slots[request.lora_int_id] = slot
        return slot

    def _free_slot(self, keep: dict) -> int:
        used = set(self.slots.values())
        free = next((slot for slot in range(self.max_loras) if slot not in used), None)
        if free is not None:
            return free
        victim = next(lora_id for lora_id in self.slots if lora_id not in keep)  # least recently used
        return self.slots.pop(victim)

    def _load(self, slot: int, request: LoRARequest) -> None:
        weights = read_adapter(request, check_adapter(request, self.max_rank, self.targets), self.dtype)
        for index, layer in enumerate(self.layers):
            mine = {target: pair for (at, target), pair in weights.items() if at == index}
            for lora in layer.values():
                lora.set_slot(slot, mine)
        self.loads += 1


def _runs(slots: list[int | None]) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each maximal run of rows with the same slot (None rows: the base, no run)."""
    runs, start = [], 0
    for index in range(1, len(slots) + 1):
        if index == len(slots) or slots[index] != slots[start]:
            if slots[start] is not None:
                runs.append((slots[start], start, index))
            start = index
    return runs
