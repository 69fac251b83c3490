"""Counters a worker keeps for its status endpoint, routing stats and metrics."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields

from workers.engine import LLMEngine

PAIR_SAMPLES = 512  # transfer durations kept per pair for its percentiles


def percentiles(values, qs=(50, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (the ingress's request figures use the same rule)."""
    ordered = sorted(values)
    if not ordered:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] for q in qs}


# The engine's KV tier figures a worker reports (EngineStats; 0 without tiers).
TIER_FIELDS = (
    "host_blocks",
    "host_capacity",
    "disk_blocks",
    "disk_capacity",
    "host_spills",
    "disk_spills",
    "host_hits",
    "disk_hits",
    "tier_loads",
    "tier_load_s",
    "host_load_s",
    "disk_load_s",
    "num_loading",
)


@dataclass
class PairStats:
    """One peer of this worker (for a decode worker: a prefill worker it pulled KV from)."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    recomputed_prefills: int = 0
    pair_groups: int = 0  # process groups created with this peer (the first, then one after each failure)
    # Groups created since the last failure, counted when a transfer over one succeeds: a failure
    # tears the pair's group down, so >= 1 says the pair works again over a new group.
    pair_groups_since_failure: int = 0
    recent_seconds: deque = field(default_factory=lambda: deque(maxlen=PAIR_SAMPLES))

    def transferred(self, num_bytes: int, seconds: float, created_pair: bool = False) -> None:
        self.pair_groups += int(created_pair)
        self.pair_groups_since_failure += int(created_pair)
        self.transfers += 1
        self.transfer_bytes += num_bytes
        self.transfer_seconds += seconds
        self.recent_seconds.append(seconds)

    def failed(self, recomputed: bool = True) -> None:
        self.transfer_failures += 1
        self.recomputed_prefills += int(recomputed)
        self.pair_groups_since_failure = 0

    def snapshot(self) -> dict:
        p = percentiles(tuple(self.recent_seconds))  # tuple(): one C-level copy, safe across threads
        return {
            "transfers": self.transfers,
            "transfer_bytes": self.transfer_bytes,
            "transfer_seconds": self.transfer_seconds,
            "transfer_failures": self.transfer_failures,
            "recomputed_prefills": self.recomputed_prefills,
            "pair_groups": self.pair_groups,
            "pair_groups_since_failure": self.pair_groups_since_failure,
            "transfer_p50_s": p["p50"],
            "transfer_p99_s": p["p99"],
            "transfer_samples": len(self.recent_seconds),
        }


@dataclass
class WorkerStats:
    role: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # served from this worker's own prefix cache
    generated_tokens: int = 0
    # prefill: requests that arrived (counted when they start, not when they finish) and their
    # prompt tokens: what the pool is asked for, even while it cannot keep up
    received: int = 0
    received_prompt_tokens: int = 0
    received_prompt_tokens_sq: int = 0  # their squares, summed: the lengths' spread
    # prefill: requests handed to decode and the max_tokens they asked for (decode's inflow);
    # decode: sequences finished here, the tokens they produced and the max_tokens they asked for
    handed_over: int = 0
    handed_over_max_tokens: int = 0
    # ... their prompt tokens, and per request prompt x max_tokens and max_tokens², summed: the
    # decode KV they will hold (a long prompt often comes with a short output: the means' product
    # is not the product's mean)
    handed_over_prompt_tokens: int = 0
    handed_over_prompt_x_max: int = 0
    handed_over_max_sq: int = 0
    finished_seqs: int = 0
    finished_output_tokens: int = 0
    finished_max_tokens: int = 0
    finished_resident_s: float = 0.0  # decode: seconds finished sequences held KV here, summed
    # decode: of those, the seconds before each one's first decoded token (its KV pull, a wait for
    # a step), summed: a stay = that setup + its tokens x the wall time of a token
    finished_setup_s: float = 0.0
    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    transfer_corrupt: int = 0  # of those, transfers whose blocks arrived with other checksums
    recomputed_prefills: int = 0
    leases_expired: int = 0
    # decode: handed-over prompts that had to wait for KV room here, and those waiting now
    kv_waits: int = 0
    kv_waiting: int = 0
    retired_streams: int = 0  # decode: streams ended early because Serve was stopping this replica
    moved_out: int = 0  # decode: running streams moved live to another decode replica
    # a tensor-parallel worker: bytes each rank moved (index = rank), summed over its transfers
    transfer_rank_bytes: list[int] = field(default_factory=list)
    # per peer worker id; a decode worker's peers are the prefill workers it pulls from
    peers: dict[str, PairStats] = field(default_factory=dict)
    # when recent transfers failed (time.monotonic()), for link-aware routing
    failure_times: deque = field(default_factory=lambda: deque(maxlen=64))

    def transfer_failed(self) -> None:
        self.transfer_failures += 1
        self.failure_times.append(time.monotonic())

    def add_rank_bytes(self, rank_bytes) -> None:
        if len(self.transfer_rank_bytes) < len(rank_bytes):
            self.transfer_rank_bytes.extend([0] * (len(rank_bytes) - len(self.transfer_rank_bytes)))
        for rank, nbytes in enumerate(rank_bytes):
            self.transfer_rank_bytes[rank] += nbytes

    def recent_failures(self, window_s: float) -> int:
        """Transfers that failed in the last `window_s` seconds."""
        since = time.monotonic() - window_s
        return sum(1 for t in tuple(self.failure_times) if t >= since)

    def peer(self, worker_id: str) -> PairStats:
        stats = self.peers.get(worker_id)
        if stats is None:
            stats = self.peers[worker_id] = PairStats()
        return stats

    def counters(self) -> dict:
        skip = ("peers", "failure_times", "transfer_rank_bytes")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip} | {
            "transfer_rank_bytes": list(self.transfer_rank_bytes)
        }

    def pairs(self) -> dict[str, dict]:
        return {peer: stats.snapshot() for peer, stats in list(self.peers.items())}

    def snapshot(self, engine: LLMEngine) -> dict:
        """Counters plus the engine's live state. Call on the engine thread (EngineLoop.call)."""
        state = engine.stats()
        return {
            **self.counters(),
            "total_blocks": state.num_blocks,
            "free_blocks": state.num_free_blocks,
            "kv_usage": state.usage,
            "num_running": state.num_running,
            "num_waiting": state.num_waiting + self.kv_waiting,  # queued in the engine or for KV room
            "num_held": state.num_held,
            "preemptions": state.preemptions,
            "busy_s": state.busy_s,
            "prefill_tokens_computed": state.prefill_tokens_computed,
            "decode_tokens": state.decode_tokens,
            "decode_token_s": state.decode_token_s,
            "decode_steps": state.decode_steps,
            "decode_step_s": state.decode_step_s,
            "decode_rows_sq": state.decode_rows_sq,
            "running_left": [list(pair) for pair in engine.running_left()],
            "prefix_queries": state.prefix_queries,
            "prefix_hits": state.prefix_hits,
            "cached_blocks": state.num_cached_blocks,
            **{f: getattr(state, f) for f in TIER_FIELDS},
            "pairs": self.pairs(),
        }
