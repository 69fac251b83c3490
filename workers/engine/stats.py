"""What the engine reports about itself: a frozen snapshot, read by workers and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The KV cache and the request table at one moment (``LLMEngine.stats()``).

    Counters (``preemptions``, ``evictions``, ``prefix_*``) run from the engine's start.
    """

    num_blocks: int
    num_free_blocks: int  # unreferenced; cached ones among them stay revivable until evicted
    num_cached_blocks: int  # registered in the prefix cache, referenced or free
    num_waiting: int
    num_running: int
    num_awaiting_kv: int  # decode side: blocks reserved, KV in flight from a prefill worker
    num_held: int  # prefill side: finished, blocks kept for a decode worker's pull
    preemptions: int
    evictions: int  # cached blocks handed out again (each one a BlockRemoved event)
    prefix_queries: int  # prompt tokens looked up in the prefix cache, once per request
    prefix_hits: int  # of those, tokens found cached
    busy_s: float = 0.0  # seconds spent running the model (steps with work), since the start
    # prompt tokens those steps computed (prefill chunks, cached tokens not included), since the start
    prefill_tokens_computed: int = 0
    # tokens decode rows produced, and the seconds of the steps that produced them summed per token
    # (their ratio is the time per output token of the sequences decoding, since the start)
    decode_tokens: int = 0
    decode_token_s: float = 0.0
    # steps that ran decode rows, their seconds, and their rows squared, since the start: with the
    # two above, the sums of a least-squares fit of a step's time against its rows
    decode_steps: int = 0
    decode_step_s: float = 0.0
    decode_rows_sq: int = 0
    # KV tiers under the device pool (workers/engine/kv_tiers.py), all 0 without them: blocks held
    # and capacity per tier; blocks copied down (spills) and loaded back (hits) per tier, and the
    # loads' count and seconds, since the start; requests waiting for a load now
    host_blocks: int = 0
    host_capacity: int = 0
    disk_blocks: int = 0
    disk_capacity: int = 0
    host_spills: int = 0
    disk_spills: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    tier_loads: int = 0
    tier_load_s: float = 0.0
    host_load_s: float = 0.0  # of those, seconds loading blocks from host memory and from disk
    disk_load_s: float = 0.0
    num_loading: int = 0

    @property
    def usage(self) -> float:
        """Fraction of the blocks referenced by a request."""
        return 1.0 - self.num_free_blocks / self.num_blocks
