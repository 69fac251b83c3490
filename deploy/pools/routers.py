"""Serve request routers for the worker pools.

``PrefixAwareRouter`` (prefill and colocated pools): asks the Redis prefix index how many
leading blocks of the prompt each live replica holds and prefers the longest match, unless the
match is short or that replica's queue is longer than the shortest by more than the imbalance
threshold; then it falls back to the least loaded replica (shortest queue, ties at random), so
one hot prefix cannot pile every request onto one replica. Least loaded, not Serve's default
power-of-two-choices: a prefill pool is a few replicas each busy for a whole prompt, and two
random picks of three often both land on busy replicas while the third is idle, so more prompts
wait past their TTFT budget than with the shortest queue. The routed-but-not-
completed counts below keep one router from sending a burst to the same replica between two
stats refreshes. ``prefill_routing: power_of_two`` keeps two random choices (no prefix).

Tiers: a worker's prefix blocks may sit on device, in host memory or on disk, and the index says
how many of each match (``PrefixIndex.prefix_matches``). While every match is on device the rule
above holds unchanged (a device block is free to reuse, so among holders longer is faster; pools
without offload route exactly as before). Once some match has host or disk blocks the longest
match is no longer the fastest, and ``rank_by_cost`` ranks replicas by estimated time to first
token instead: queue x ``queued_request_s`` + host blocks x ``host_block_s`` + disk blocks x
``disk_block_s`` + blocks not held x ``prefill_block_s`` (``TierCosts``). Defaults are built in; a
replica overrides them by publishing ``prefill_block_s``, ``host_load_block_s``,
``disk_load_block_s`` or ``queued_request_s`` in its ``routing_stats``. The same guards apply: a
match shorter than ``min_match_blocks``, or held by a replica more than the imbalance threshold
behind the shortest queue, earns no credit (that replica is costed as recomputing everything).

Link-aware: a prefill replica whose KV sends failed ``LINK_FAILURE_THRESHOLD`` times in the last
``LINK_FAILURE_WINDOW_S`` seconds (its link down or too slow for the transfer deadline; it says so
in its ``routing_stats``) is tried last, after every other replica, prefix match or not: a
prompt recomputed by another prefill replica costs less than one recomputed by decode after a
failed transfer. Once its failures age out of the window it gets requests again (the probe that
finds the link repaired). When every replica is failing, nothing is demoted.

``DecodeRouter`` (decode pool): the replica with the most free KV blocks, preferring one whose
own cache already holds the prefix (then only the missing blocks move).

Both are written against Serve's public router API only (``ray.serve.request_router``):
``choose_replicas`` ranks the candidates; a replica's load is what it publishes in its
``routing_stats`` (engine queue, free KV blocks, recent transfer failures, refreshed every
second), raised to the requests this router has routed to it and not seen complete (the
``on_request_routed``/``on_request_completed`` hooks), so a burst between two stats refreshes
does not pile onto one replica. No call is pinned to a replica: what must reach one particular
worker (a KV transfer's control calls) goes to it directly (``workers/transfer/control.py``).
The routing policy is in pure functions (``rank_by_prefix``, ``rank_by_cost``,
``rank_for_decode``) kept apart from Serve's machinery.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvstore.record import PrefixMatch

if TYPE_CHECKING:
    from kvstore import PrefixIndex  # imported when first used: a router without Redis never needs it

logger = logging.getLogger("pdserve")


LINK_FAILURE_WINDOW_S = 30.0
LINK_FAILURE_THRESHOLD = 2


def queue_len(routing_stats: dict[str, Any], in_flight: int = 0) -> int:
    """A replica's load for routing: its engine's running plus waiting sequences as it last
    published them, or the requests routed to it and not yet completed, if more."""
    published = int(routing_stats.get("num_running", 0)) + int(routing_stats.get("num_waiting", 0))
    return max(published, in_flight)


def demote_failing(ranks: list[list[Any]], failing: set) -> list[list[Any]]:
    """The same ranks with the replicas in `failing` moved to a last rank of their own; unchanged
    when no replica, or every replica, is failing."""
    if not failing:
        return ranks
    kept = [[r for r in rank if r not in failing] for rank in ranks]
    kept = [rank for rank in kept if rank]
    if not kept:
        return ranks
    return kept + [[r for rank in ranks for r in rank if r in failing]]


def power_of_two(replicas: Sequence[Any], queue_len: dict[Any, int], rng=random) -> list[list[Any]]:
    """Two random replicas, shorter queue first; the rest after them."""
    if len(replicas) <= 2:
        return [sorted(replicas, key=lambda r: queue_len.get(r, 0))]
    a, b = rng.sample(list(replicas), 2)
    pair = sorted((a, b), key=lambda r: queue_len.get(r, 0))
    return [pair, [r for r in replicas if r is not a and r is not b]]


def least_loaded(replicas: Sequence[Any], queue_len: dict[Any, int], rng=random) -> list[list[Any]]:
    """Every replica in a rank of its own, shortest queue first (equal queues in random order)."""
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    return [[r] for r in sorted(shuffled, key=lambda r: queue_len.get(r, 0))]


def rank_by_prefix(
    replicas: Sequence[Any],
    matched_blocks: dict[Any, int] | None,
    queue_len: dict[Any, int],
    min_match_blocks: int,
    imbalance_threshold: int,
    rng=random,
    by_load=least_loaded,
) -> tuple[list[list[Any]], bool]:
    """Ranks of replicas, and whether the prefix decided (False: load alone, ``by_load``)."""
    if matched_blocks:
        best = max(replicas, key=lambda r: (matched_blocks.get(r, 0), -queue_len.get(r, 0)))
        shortest = min(queue_len.get(r, 0) for r in replicas)
        if matched_blocks.get(best, 0) >= min_match_blocks and queue_len.get(best, 0) - shortest <= imbalance_threshold:
            rest = [r for r in replicas if r is not best]
            return [[best]] + (by_load(rest, queue_len, rng) if rest else []), True
    return by_load(replicas, queue_len, rng), False


# routing_stats key a replica may publish -> the TierCosts field it overrides
TIER_COST_STATS = {
    "prefill_block_s": "prefill_block_s",
    "host_load_block_s": "host_block_s",
    "disk_load_block_s": "disk_block_s",
    "queued_request_s": "queued_request_s",
}


@dataclass(frozen=True)
class TierCosts:
    """Seconds a prefill replica spends per KV block, by where the block comes from, and per
    request ahead of a new one in its queue. Defaults are rough figures for a GPU replica; only
    their order matters much (host load < disk load < recompute)."""

    prefill_block_s: float = 2e-3  # recompute one block
    host_block_s: float = 2e-4  # copy one block from host memory to the device
    disk_block_s: float = 1e-3  # read one block from local disk and copy it up
    queued_request_s: float = 5e-2  # wait behind one queued or running request

    @classmethod
    def from_routing_stats(cls, routing_stats: Mapping[str, Any], default: TierCosts | None = None) -> TierCosts:
        """The costs a replica publishes, each absent or unusable one (not a finite number >= 0)
        taken from ``default``."""
        base = default or cls()
        values = {f.name: getattr(base, f.name) for f in fields(cls)}
        for key, name in TIER_COST_STATS.items():
            try:
                value = float(routing_stats[key])
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(value) and value >= 0:
                values[name] = value
        return cls(**values)

    def ttft_s(self, queued: int, match: PrefixMatch, num_prompt_blocks: int) -> float:
        """Estimated time to first token: wait for the queue, load what is held off device,
        recompute what is not held."""
        missing = max(num_prompt_blocks - match.blocks, 0)
        return (
            queued * self.queued_request_s
            + match.host * self.host_block_s
            + match.disk * self.disk_block_s
            + missing * self.prefill_block_s
        )


NO_MATCH = PrefixMatch(0)


def rank_by_cost(
    replicas: Sequence[Any],
    matches: Mapping[Any, PrefixMatch] | None,
    queue_len: Mapping[Any, int],
    num_prompt_blocks: int,
    costs: Mapping[Any, TierCosts] | None = None,
    min_match_blocks: int = 1,
    imbalance_threshold: int | None = None,
    rng=random,
) -> tuple[list[list[Any]], bool]:
    """Every replica in a rank of its own, lowest estimated TTFT first (``TierCosts.ttft_s``; a
    replica missing from ``costs`` gets the defaults); ties: shorter queue, then random. A match
    shorter than ``min_match_blocks``, or on a replica more than ``imbalance_threshold`` behind
    the shortest queue, counts as none. Also returns whether the first replica's match counted."""
    matches = matches or {}
    costs = costs or {}
    default = TierCosts()
    shortest = min((queue_len.get(r, 0) for r in replicas), default=0)

    def credited(r: Any) -> PrefixMatch:
        match = matches.get(r, NO_MATCH)
        if match.blocks < max(min_match_blocks, 1):
            return NO_MATCH
        if imbalance_threshold is not None and queue_len.get(r, 0) - shortest > imbalance_threshold:
            return NO_MATCH
        return match

    shuffled = list(replicas)
    rng.shuffle(shuffled)
    estimate = {r: costs.get(r, default).ttft_s(queue_len.get(r, 0), credited(r), num_prompt_blocks) for r in shuffled}
    ordered = sorted(shuffled, key=lambda r: (estimate[r], queue_len.get(r, 0)))
    return [[r] for r in ordered], bool(ordered) and credited(ordered[0]).blocks > 0


def rank_for_decode(
    replicas: Sequence[Any],
    matched_blocks: dict[Any, int] | None,
    free_blocks: dict[Any, int],
    blocks_needed: int,
) -> list[list[Any]]:
    """Replicas that can hold the request, prefix holders first, then by free blocks."""
    matched_blocks = matched_blocks or {}

    def key(r):
        fits = free_blocks.get(r, 0) + matched_blocks.get(r, 0) >= blocks_needed
        return (fits, matched_blocks.get(r, 0) if fits else 0, free_blocks.get(r, 0))

    ordered = sorted(replicas, key=key, reverse=True)
    return [[r] for r in ordered]


class _IndexRouter(FIFOMixin, RequestRouter):
    # Serve calls this with the deployment's request_router_kwargs; naming them (Serve's own
    # pattern) narrows the base's **kwargs, which mypy reads as breaking the override.
    def initialize_state(  # type: ignore[override]
        self,
        redis_url: str | None = None,
        model_key: str = "",
        role: str = "prefill",
        min_match_blocks: int = 2,
        imbalance_threshold: int = 8,
        block_size: int = 16,
        policy: str = "cache_aware",
    ) -> None:
        self._redis_url, self._model_key, self._role = redis_url, model_key, role
        self._min_match_blocks, self._imbalance_threshold = min_match_blocks, imbalance_threshold
        self._block_size = block_size
        self._policy = policy
        self._next = 0  # round-robin position
        self._index: PrefixIndex | None = None
        self.decisions = {"prefix": 0, "load": 0}
        self._in_flight: dict[str, int] = {}  # replica id -> requests routed there, not completed
        self._routed: dict[str, str] = {}  # internal request id -> replica id

    async def _lookup(self, request: Any, tiers: bool = False) -> dict[str, PrefixMatch] | None:
        """Each live worker's match of the request's prefix; host/disk counted only if ``tiers``
        (otherwise every block reads as on device: the lookup skips the tier reads)."""
        hashes = getattr(request, "block_hashes", ()) if request is not None else ()
        if not self._redis_url or not hashes:
            return None
        if self._index is None:
            from kvstore import IndexConfig, PrefixIndex

            self._index = PrefixIndex(IndexConfig(redis_url=self._redis_url, model_key=self._model_key))
            await self._index.start()
        if tiers:
            return await self._index.prefix_matches(list(hashes), role=self._role)
        blocks = await self._index.longest_prefix(list(hashes), role=self._role)
        return None if blocks is None else {worker_id: PrefixMatch(n) for worker_id, n in blocks.items()}

    def _queue_lens(self, replicas: Sequence[RunningReplica]) -> dict[RunningReplica, int]:
        return {r: queue_len(r.routing_stats, self._in_flight.get(r.replica_id.unique_id, 0)) for r in replicas}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        self._routed[pending_request.metadata.internal_request_id] = rid
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, replica_id.unique_id)
        if self._in_flight.get(rid, 0) > 1:
            self._in_flight[rid] -= 1
        else:
            self._in_flight.pop(rid, None)

    @staticmethod
    def _request(pending: PendingRequest | None) -> Any:
        if pending is None or not pending.args:
            return None
        return pending.args[0]


class PrefixAwareRouter(_IndexRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if self._policy == "round_robin":  # the baseline cache-aware routing is measured against
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            self._next += 1
            start = self._next % len(ordered)
            return [[r] for r in ordered[start:] + ordered[:start]]
        request = self._request(pending_request)
        matches = None
        if self._policy == "cache_aware":
            matches = await self._lookup(request, tiers=True)
        by_replica = None
        if matches:
            by_replica = {r: matches.get(r.replica_id.unique_id, NO_MATCH) for r in candidate_replicas}
        queues = self._queue_lens(candidate_replicas)
        if by_replica and any(m.host or m.disk for m in by_replica.values()):
            ranks, by_prefix = rank_by_cost(
                candidate_replicas,
                by_replica,
                queues,
                len(getattr(request, "block_hashes", ())),
                {r: TierCosts.from_routing_stats(r.routing_stats) for r in candidate_replicas},
                self._min_match_blocks,
                self._imbalance_threshold,
            )
        else:
            ranks, by_prefix = rank_by_prefix(
                candidate_replicas,
                {r: m.blocks for r, m in by_replica.items()} if by_replica else None,
                queues,
                self._min_match_blocks,
                self._imbalance_threshold,
                by_load=power_of_two if self._policy == "power_of_two" else least_loaded,
            )
        self.decisions["prefix" if by_prefix else "load"] += 1
        failing = {
            r
            for r in candidate_replicas
            if int(r.routing_stats.get("recent_transfer_failures", 0)) >= LINK_FAILURE_THRESHOLD
        }
        if failing:
            self.decisions["demoted"] = self.decisions.get("demoted", 0) + 1
        return demote_failing(ranks, failing)


class DecodeRouter(_IndexRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = self._request(pending_request)
        matches = await self._lookup(request)
        by_replica = None
        if matches:  # a holder in any tier: its blocks need not move
            by_replica = {r: matches.get(r.replica_id.unique_id, NO_MATCH).blocks for r in candidate_replicas}
        free = {r: int(r.routing_stats.get("free_blocks", 0)) for r in candidate_replicas}
        num_tokens = len(getattr(request, "prompt_token_ids", ())) + 1
        needed = -(-num_tokens // self._block_size)
        ranks = rank_for_decode(candidate_replicas, by_replica, free, needed)
        avoid = set(getattr(request, "avoid_workers", ()) or ())
        return demote_failing(ranks, {r for r in candidate_replicas if r.replica_id.unique_id in avoid})
