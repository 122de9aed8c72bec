"""Conveyor's synchronous engine core: paged KV cache, continuous batching, offline API.

Names are imported on first use (PEP 562): `engine.config` alone (what the `conveyor`
command needs to build its flags) does not load torch or transformers."""

import importlib

_EXPORTS = {
    "EngineConfig": "engine.config",
    "InvalidRequest": "engine.errors",
    "ModelLoadError": "engine.errors",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
    "LoRARequest": "engine.lora.request",
}
__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestMetrics",
    "InvalidRequest",
    "ModelLoadError",
    "LoRARequest",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
