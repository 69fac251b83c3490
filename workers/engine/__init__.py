"""The serving engine: paged KV cache, prefix caching, continuous batching. No Ray, no Redis."""

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine, RequestFailed, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import RequestStatus
from workers.engine.stats import EngineStats

__all__ = [
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestFailed",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]
