"""Conveyor: an LLM inference engine with a Redis Streams front door.

The offline API is vLLM's: ``from conveyor import LLM, SamplingParams``. The names load on
first use (PEP 562), so ``import conveyor.clients`` (the light producer client) never
imports torch or transformers through this package."""

import importlib

__version__ = "0.2.0"

_ENGINE_EXPORTS = (
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
)
__all__ = [*_ENGINE_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _ENGINE_EXPORTS:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module("conveyor.engine"), name)
    globals()[name] = value
    return value
