"""Counters a worker keeps for its status endpoint, routing stats and metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from workers.engine import LLMEngine


@dataclass
class WorkerStats:
    role: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # served from this worker's own prefix cache
    generated_tokens: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    recomputed_prefills: int = 0
    leases_expired: int = 0

    def snapshot(self, engine: LLMEngine) -> dict:
        """Counters plus the engine's live state. Call on the engine thread (EngineLoop.call)."""
        bm = engine.block_manager
        return {
            **asdict(self),
            "total_blocks": bm.num_blocks,
            "free_blocks": bm.num_free_blocks,
            "kv_usage": bm.usage,
            "num_running": len(engine.scheduler.running),
            "num_waiting": len(engine.scheduler.waiting),
            "num_held": engine.num_held,
            "preemptions": engine.scheduler.num_preemptions,
            "prefix_queries": bm.stats.prefix_queries,
            "prefix_hits": bm.stats.prefix_hits,
            "cached_blocks": bm.num_cached_blocks,
        }

