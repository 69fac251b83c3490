"""The serving engine: paged KV cache, prefix caching, continuous batching. No Ray, no Redis."""

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine, RequestOutput
from workers.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
