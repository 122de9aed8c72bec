"""Conveyor's synchronous engine core: paged KV cache, continuous batching, offline API."""
from engine.config import EngineConfig
from engine.errors import InvalidRequest, ModelLoadError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics",
           "InvalidRequest", "ModelLoadError"]
