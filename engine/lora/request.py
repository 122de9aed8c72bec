"""vLLM's LoRARequest: which adapter a request runs with."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_int_id`` (>= 1) names the adapter inside the engine (its slot, its prefix-cache
    entries); ``lora_path`` is a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
