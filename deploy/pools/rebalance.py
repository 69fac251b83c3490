"""KV-pressure rebalancing: a decode replica about to preempt moves a stream live to another
decode replica with room instead (Llumnix's load balancing by migration).

Preemption frees a running sequence's blocks and recomputes it later: its stream stalls for a
whole prefill of prompt + tokens so far, and the replica spends that compute again. When this
replica's free blocks fall below one per running sequence (each may need a new block within the
next ``block_size`` steps), the sequence the scheduler would preempt first (the last admitted)
moves to the decode replica the index shows with the most free blocks, if that one can hold it
with room to spare; its stream goes on there with nothing recomputed
(``DecodeWorker.move``: the ingress continues it, the decode router places it by free blocks).
One move at a time per replica; the next waits until the last one's blocks were pulled. The
step observer wakes it (``on_step``, engine thread) only when the KV is short: an idle or
unpressed replica costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RETRY_S = 0.1  # a look that moved nothing waits this long before the next
INDEX_MAX_AGE_S = 0.5  # other replicas' free blocks (the index's records) are read at most this often


@dataclass(frozen=True, slots=True)
class LocalKV:
    free_blocks: int
    num_running: int
    # (request id, blocks it may come to hold) of the sequence preemption would take first
    candidate: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class PeerKV:
    worker_id: str
    free_blocks: int
    num_running: int


def kv_short(free_blocks: int, num_running: int, blocks_per_seq: float) -> bool:
    """Fewer free blocks than ``blocks_per_seq`` per running sequence, with more than one running
    (moving the only one frees nothing it needs): a preemption is near."""
    return num_running >= 2 and free_blocks < blocks_per_seq * num_running


def choose_move(local: LocalKV, peers: list[PeerKV], blocks_per_seq: float = 1.0) -> tuple[str, str] | None:
    """(request id, peer) to move now, or None. A move happens when this replica has fewer free
    blocks than ``blocks_per_seq`` per running sequence, more than one sequence runs (moving the
    only one frees nothing it needs), and a peer has room for every block the candidate may come
    to hold (a move that makes the peer preempt gains nothing) plus ``blocks_per_seq`` for each
    of its own sequences and the newcomer."""
    if local.candidate is None or not kv_short(local.free_blocks, local.num_running, blocks_per_seq):
        return None
    request_id, blocks = local.candidate

    def spare(peer: PeerKV) -> float:
        return peer.free_blocks - blocks - blocks_per_seq * (peer.num_running + 1)

    best = max(peers, key=spare, default=None)
    if best is None or spare(best) < 0:
        return None
    return request_id, best.worker_id


class Rebalancer:
    """Runs ``choose_move`` for one decode replica whenever its step observer finds the KV short
    (``worker``: its ``DecodeWorker``; ``index``: a ``PrefixIndex`` for the other replicas'
    figures)."""

    def __init__(self, worker, index, worker_id: str, blocks_per_seq: float = 1.0) -> None:
        self.worker = worker
        self.index = index
        self.worker_id = worker_id
        self.blocks_per_seq = blocks_per_seq
        self.moves = 0
        self._peers: list[PeerKV] = []
        self._peers_at = -1.0
        self._task: asyncio.Task | None = None
        self._short = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    def on_step(self, free_blocks: int, num_running: int) -> None:
        """Engine thread, after each step: wake the rebalancer when the KV is short."""
        if self._loop is not None and kv_short(free_blocks, num_running, self.blocks_per_seq):
            self._loop.call_soon_threadsafe(self._short.set)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._short.wait()
            self._short.clear()
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - a failed look is retried; serving goes on
                logger.warning("decode %s: KV rebalancing check failed", self.worker_id, exc_info=True)
            await asyncio.sleep(RETRY_S)  # steps that stay short meanwhile set the event again

    async def check(self) -> str | None:
        """One look; the id of the stream moved, if any."""
        source = self.worker.source
        if source is None or self.worker.retiring or source.num_leases:
            return None  # no live moves here, stopping, or the last move's blocks are not pulled yet
        local = await self.worker.loop.call(_local_kv)
        if local.candidate is None or not kv_short(local.free_blocks, local.num_running, self.blocks_per_seq):
            return None  # no longer short: the index need not be read
        choice = choose_move(local, await self._peer_kv(), self.blocks_per_seq)
        if choice is None:
            return None
        request_id, peer = choice
        moved = await self.worker.move(request_id)
        if moved:
            self.moves += 1
            logger.info(
                "decode %s: %d free KV blocks for %d sequences; moving %s live (%d blocks) to make room (%s has %s)",
                self.worker_id,
                local.free_blocks,
                local.num_running,
                request_id,
                local.candidate[1],
                peer,
                next((p.free_blocks for p in self._peers if p.worker_id == peer), "?"),
            )
            self._peers_at = -1.0  # the peer's room changed: read it afresh next time
            return request_id
        return None

    async def _peer_kv(self) -> list[PeerKV]:
        now = asyncio.get_running_loop().time()
        if now - self._peers_at >= INDEX_MAX_AGE_S:
            records = await self.index.live_workers(role="decode") or {}
            self._peers = [
                PeerKV(r.worker_id, r.free_blocks, r.num_running)
                for r in records.values()
                if r.worker_id != self.worker_id
            ]
            self._peers_at = now
        return self._peers


def _local_kv(engine) -> LocalKV:
    """Engine thread: this replica's free blocks, running sequences, and the preemption candidate."""
    stats = engine.stats()
    return LocalKV(stats.num_free_blocks, stats.num_running, engine.preemption_candidate())
