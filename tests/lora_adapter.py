"""A PEFT LoRA adapter made at test time for a tiny model, its weights large enough to change
greedy outputs (PEFT's own init starts B at zero: no change at all)."""

from __future__ import annotations

import torch


def make_adapter(model_dir: str, out_dir, seed: int, targets: list[str], rank: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change greedy outputs
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return str(out_dir)
