"""Conveyor's synchronous engine core: paged KV cache, continuous batching, offline API.

Names are imported on first use (PEP 562): `conveyor.engine.config` alone (what the `conveyor`
command needs to build its flags) does not load torch or transformers."""

import importlib

_EXPORTS = {
    "EngineConfig": "conveyor.engine.config",
    "InvalidRequest": "conveyor.engine.errors",
    "ModelLoadError": "conveyor.engine.errors",
    "LLM": "conveyor.engine.llm",
    "LLMEngine": "conveyor.engine.llm_engine",
    "RequestMetrics": "conveyor.engine.outputs",
    "RequestOutput": "conveyor.engine.outputs",
    "SamplingParams": "conveyor.engine.sampling_params",
    "StructuredOutputsParams": "conveyor.engine.structured_outputs",
    "LoRARequest": "conveyor.engine.lora.request",
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
        raise AttributeError(f"module 'conveyor.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
