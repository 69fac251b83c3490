"""Serve request routers for the worker pools.

``PrefixAwareRouter`` (prefill and colocated pools): asks the Redis prefix index how many
leading blocks of the prompt each live replica holds and prefers the longest match, unless the
match is short or that replica's queue is longer than the shortest by more than the imbalance
threshold; then it falls back to power-of-two-choices, so one hot prefix cannot pile every
request onto one replica.

Link-aware: a prefill replica whose KV sends failed ``LINK_FAILURE_THRESHOLD`` times in the last
``LINK_FAILURE_WINDOW_S`` seconds (its link down or too slow for the transfer deadline; it says so
in its ``routing_stats``) is tried last, after every other replica, prefix match or not: a
prompt recomputed by another prefill replica costs less than one recomputed by decode after a
failed transfer. Once its failures age out of the window it gets requests again (the probe that
finds the link repaired). When every replica is failing, nothing is demoted.

``DecodeRouter`` (decode pool): the replica with the most free KV blocks, preferring one whose
own cache already holds the prefix (then only the missing blocks move).

Both honour ``target_replica=<replica id>`` in a call's kwargs: a call that must reach the
replica holding a lease (send_kv, release_kv) goes there and nowhere else. The routing policy is
in pure functions (``rank_by_prefix``, ``rank_for_decode``) kept apart from Serve's machinery.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger("pdserve")


LINK_FAILURE_WINDOW_S = 30.0
LINK_FAILURE_THRESHOLD = 2


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


def rank_by_prefix(
    replicas: Sequence[Any],
    matched_blocks: dict[Any, int] | None,
    queue_len: dict[Any, int],
    min_match_blocks: int,
    imbalance_threshold: int,
    rng=random,
) -> tuple[list[list[Any]], bool]:
    """Ranks of replicas, and whether the prefix decided (False: load alone)."""
    if matched_blocks:
        best = max(replicas, key=lambda r: (matched_blocks.get(r, 0), -queue_len.get(r, 0)))
        shortest = min(queue_len.get(r, 0) for r in replicas)
        if (matched_blocks.get(best, 0) >= min_match_blocks
                and queue_len.get(best, 0) - shortest <= imbalance_threshold):
            rest = [r for r in replicas if r is not best]
            return [[best]] + (power_of_two(rest, queue_len, rng) if rest else []), True
    return power_of_two(replicas, queue_len, rng), False


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


def _target(pending: PendingRequest) -> str | None:
    return pending.kwargs.get("target_replica") if pending.kwargs else None


class _PinningFIFORouter(FIFOMixin, RequestRouter):
    """FIFO routing that never hands a pinned call to another replica.

    Serve's FIFO policy gives the replica chosen for one request to the oldest pending request;
    with calls pinned to different replicas (concurrent send_kv from one decode replica, the
    status endpoint asking every replica) that would swap their destinations. Here a pinned
    request takes only the replica chosen for it, and the FIFO scan skips pinned requests that
    want another replica. (Written against Ray Serve 2.60's router internals.)
    """

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        own = self._get_pending_request_matching_internal_request_id(request_metadata)
        if own is not None and _target(own) is not None:
            self._assign(own, replica)
            return
        queue = self._pending_requests_to_fulfill
        while queue and queue[0].future.done():
            queue.popleft()
        for pending in list(queue):
            if pending.future.done():
                continue
            target = _target(pending)
            if target is None or target == replica.replica_id.unique_id:
                queue.remove(pending)
                self._assign(pending, replica)
                return

    def _assign(self, pending: PendingRequest, replica: RunningReplica) -> None:
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)


class _IndexRouter(_PinningFIFORouter):
    def initialize_state(
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
        self._index = None
        self.decisions = {"prefix": 0, "load": 0, "pinned": 0}

    async def _lookup(self, request: Any) -> dict[str, int] | None:
        hashes = getattr(request, "block_hashes", ()) if request is not None else ()
        if not self._redis_url or not hashes:
            return None
        if self._index is None:
            from kvstore import IndexConfig, PrefixIndex

            self._index = PrefixIndex(IndexConfig(redis_url=self._redis_url, model_key=self._model_key))
            await self._index.start()
        return await self._index.longest_prefix([bytes.fromhex(h) for h in hashes], role=self._role)

    def _queue_lens(self, replicas: Sequence[RunningReplica]) -> dict[RunningReplica, int]:
        cache = self._replica_queue_len_cache
        return {r: cache.get(r.replica_id) or 0 for r in replicas}

    @staticmethod
    def _pinned(pending: PendingRequest | None, replicas: Sequence[RunningReplica]):
        """The replica a call is pinned to. When it is gone, any replica: returning nothing
        would stall Serve's FIFO queue behind a call that can never be placed; the callee then
        finds no lease (send_kv/release_kv fail, decode recomputes) or answers with its own id."""
        target = pending.kwargs.get("target_replica") if pending is not None else None
        if target is None:
            return None
        return [r for r in replicas if r.replica_id.unique_id == target] or list(replicas)

    @staticmethod
    def _request(pending: PendingRequest | None) -> Any:
        if pending is None or not pending.args:
            return None
        return pending.args[0]


class PrefixAwareRouter(_IndexRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pinned = self._pinned(pending_request, candidate_replicas)
        if pinned is not None:
            self.decisions["pinned"] += 1
            return [pinned] if pinned else []
        if self._policy == "round_robin":  # the baseline cache-aware routing is measured against
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            self._next += 1
            start = self._next % len(ordered)
            return [[r] for r in ordered[start:] + ordered[:start]]
        matches = None
        if self._policy == "cache_aware":
            matches = await self._lookup(self._request(pending_request))
        by_replica = None
        if matches:
            by_replica = {r: matches.get(r.replica_id.unique_id, 0) for r in candidate_replicas}
        ranks, by_prefix = rank_by_prefix(
            candidate_replicas, by_replica, self._queue_lens(candidate_replicas),
            self._min_match_blocks, self._imbalance_threshold,
        )
        self.decisions["prefix" if by_prefix else "load"] += 1
        failing = {r for r in candidate_replicas
                   if int(r.routing_stats.get("recent_transfer_failures", 0)) >= LINK_FAILURE_THRESHOLD}
        if failing:
            self.decisions["demoted"] = self.decisions.get("demoted", 0) + 1
        return demote_failing(ranks, failing)


class DecodeRouter(_IndexRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pinned = self._pinned(pending_request, candidate_replicas)
        if pinned is not None:
            return [pinned] if pinned else []
        request = self._request(pending_request)
        matches = await self._lookup(request)
        by_replica = None
        if matches:
            by_replica = {r: matches.get(r.replica_id.unique_id, 0) for r in candidate_replicas}
        free = {r: int(r.routing_stats.get("free_blocks", 0)) for r in candidate_replicas}
        num_tokens = len(getattr(request, "prompt_token_ids", ())) + 1
        needed = -(-num_tokens // self._block_size)
        return rank_for_decode(candidate_replicas, by_replica, free, needed)
