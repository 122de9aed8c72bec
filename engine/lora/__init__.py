"""LoRA adapters per request (Llama family): vLLM's LoRARequest, PEFT adapters read from
disk, and layers that add each row's own adapter to the base projections."""

from conveyor.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
