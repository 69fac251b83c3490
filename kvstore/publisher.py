"""Worker side of the Redis prefix index: publish one worker's block events and heartbeats.

Wiring (one publisher per worker start):

    publisher = IndexPublisher(config, WorkerSpec(...))
    await publisher.start()                 # on the worker's event loop; may raise
                                            # IncompatibleWorkerError or IndexAuthError
    block_manager.on_events = publisher.submit          # engine thread, never blocks
    publisher.set_load(free_blocks, num_running, num_waiting)   # after each engine step
    await publisher.stop()                  # orderly leave (deregister=False: as if killed)

Threading: ``submit`` and ``set_load`` may be called from any thread; they touch only
in-memory state under a short lock. Everything that talks to Redis runs in one background task
on the loop that called ``start`` (and in ``flush``/``stop``), serialized by an asyncio lock so
batches reach Redis in submission order.

Tiers: a block may be held in several mediums at once (``kvstore.events.MEDIUMS``); the
publisher keeps, per held hash, which mediums hold it, and sends Redis only changes of a hash's
*best tier* (the first medium of MEDIUMS that holds it) or its leaving every tier. An event that
changes no best tier (a host copy of a device block) costs Redis nothing.

Recovery: the publisher keeps the hashes the worker currently holds, with their mediums. Whenever
what Redis has may differ from it — the worker record vanished (Redis restarted empty, or the
record expired), the server's run id changed, or buffered events were dropped — it re-registers
and republishes that whole state, best tiers included, instead of replaying events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable

from kvstore import lua
from kvstore.compat import IncompatibleWorkerError, PoolCompat
from kvstore.config import IndexConfig, WorkerSpec
from kvstore.events import MEDIUMS, AllBlocksCleared, BlockStored, KVEvent
from kvstore.hashing import HASH_ALGORITHM_VERSION, BlockHash
from kvstore.index import PrefixIndex
from kvstore.keys import IndexKeys
from kvstore.link import IndexAuthError, IndexUnavailableError, RedisLink
from kvstore.record import WorkerLoad, WorkerRecord

log = logging.getLogger(__name__)

REPUBLISH_CHUNK = 2048  # hashes per script call when republishing (bounds Redis stalls)

_MEDIUM_BIT = {medium: 1 << tier for tier, medium in enumerate(MEDIUMS)}
_NOT_HELD = "-"
_CLEAR = "clear"

# (op of lua.APPLY_EVENTS, hashes): op is the best tier as a digit, _NOT_HELD or _CLEAR.
_Transition = tuple[str, tuple[BlockHash, ...]]
_Update = tuple[_Transition, ...]  # what one event changed: the queue's unit


def _best_tier_op(mediums: int) -> str:
    """The APPLY_EVENTS op for a bitmask of mediums: its lowest bit's tier, or not held."""
    return str((mediums & -mediums).bit_length() - 1) if mediums else _NOT_HELD


class IndexPublisher:
    """Publishes one worker start's block events, load and liveness (see the module docstring)."""

    def __init__(self, config: IndexConfig, worker: WorkerSpec) -> None:
        self.config = config
        self.worker = worker
        self.keys = IndexKeys(config.model_key)
        self.generation = f"{secrets.randbits(64):016x}"  # new for every worker start
        self.started_at = time.time()
        self.link = RedisLink(config, name=f"publisher of worker {worker.worker_id}")
        self.index = PrefixIndex(config, link=self.link)  # for the dead-worker sweep
        client = self.link.client
        self._register_script = client.register_script(lua.REGISTER)
        self._heartbeat_script = client.register_script(lua.HEARTBEAT)
        self._apply_script = client.register_script(lua.APPLY_EVENTS)
        self._deregister_script = client.register_script(lua.DEREGISTER)

        # Shared with the engine thread, guarded by _lock.
        self._lock = threading.Lock()
        self._queue: deque[_Update] = deque()  # best-tier changes, in event order
        self._held: dict[BlockHash, int] = {}  # hash -> bitmask of the mediums holding it (_MEDIUM_BIT)
        self._unknown_mediums: set[str] = set()
        self._needs_resync = False  # events were dropped: Redis must be rebuilt from _held
        self._dropped_events = 0
        self._stopped = False
        self._load = WorkerLoad(free_blocks=worker.total_blocks)  # replaced whole, never mutated

        # Owned by the event loop.
        self._io_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # set (on the loop) when events are queued
        self._registered = False
        self._disabled = False  # superseded by a newer start, or incompatible with the pool
        self._run_id: str | None = None
        self._seen_reconnects = 0
        self._next_heartbeat = 0.0
        self._next_purge = 0.0

    # ---- called by the worker, from any thread -------------------------------------------

    def submit(self, events: Iterable[KVEvent]) -> None:
        """Record block events and queue them for Redis. Never blocks on I/O, never raises."""
        queued = False
        with self._lock:
            if self._stopped:
                return
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    self._held.clear()
                    self._queue.clear()  # everything queued before is superseded
                    self._queue.append(((_CLEAR, ()),))
                    queued = True
                    continue
                bit = _MEDIUM_BIT.get(event.medium)
                if bit is None:
                    self._skip_unknown_medium(event.medium)
                    continue
                update = self._record(event.block_hashes, bit, isinstance(event, BlockStored))
                if update:
                    self._queue.append(update)
                    queued = True
            overflow = len(self._queue) - self.config.max_buffered_events
            if overflow > 0:
                self._drop_oldest(overflow)
        if queued:
            self._notify()

    def set_load(self, free_blocks: int, num_running: int = 0, num_waiting: int = 0) -> None:
        """Latest load; written to the worker record with the next heartbeat."""
        self._load = WorkerLoad(free_blocks, num_running, num_waiting)

    @property
    def dropped_events(self) -> int:
        return self._dropped_events

    @property
    def buffered_events(self) -> int:
        return len(self._queue)

    @property
    def registered(self) -> bool:
        return self._registered

    def held_blocks(self) -> frozenset[BlockHash]:
        """Hashes held in any tier."""
        with self._lock:
            return frozenset(self._held)

    def held_tiers(self) -> dict[BlockHash, str]:
        """Each held hash's best tier (a medium of MEDIUMS): what Redis is brought to."""
        with self._lock:
            return {h: MEDIUMS[int(_best_tier_op(mediums))] for h, mediums in self._held.items()}

    # ---- lifecycle, on the worker's event loop ---------------------------------------------

    async def start(self) -> None:
        """Register and start the background task.

        Raises IncompatibleWorkerError if the pool uses other block settings, IndexAuthError if
        Redis refuses the URL's credentials. An unreachable Redis is not an error: the worker
        registers when it comes back.
        """
        try:
            async with self._io_lock:
                await self._register()
        except (IncompatibleWorkerError, IndexAuthError):
            await self.link.aclose()
            raise
        except IndexUnavailableError:
            log.warning("worker %s will register in the prefix index when Redis is back", self.worker.worker_id)
        self._next_purge = time.monotonic() + self._purge_delay()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"index-publisher-{self.worker.worker_id}")

    async def flush(self) -> bool:
        """Publish everything queued now; True if Redis is up to date with this worker."""
        async with self._io_lock:
            with contextlib.suppress(IndexUnavailableError):
                await self._sync()
        return self._registered and not self._disabled and not self._queue and not self._needs_resync

    async def stop(self, deregister: bool = True) -> None:
        """Stop publishing. ``deregister`` removes this worker's entries now; without it the
        record expires after ``ttl_s`` and a sweep purges the entries (as if the worker died)."""
        with self._lock:
            self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister and not self._disabled:
            try:
                async with self._io_lock:
                    await self._deregister()
            except IndexUnavailableError:
                log.warning(
                    "worker %s could not leave the prefix index; its record expires in %.1fs",
                    self.worker.worker_id,
                    self.config.ttl_s,
                )
        await self.link.aclose()

    # ---- background task ------------------------------------------------------------------

    async def _run(self) -> None:
        # ``_stopped`` ends the loop even if stop()'s cancel is lost: on Python 3.11 a cancel
        # that lands as a call's deadline fires can surface as that call's TimeoutError, which
        # the loop treats as Redis being away (and stop() would wait for the task forever).
        while not self._disabled and not self._stopped:
            try:
                async with self._io_lock:
                    await self._sync()
                    if time.monotonic() >= self._next_purge and self._registered:
                        self._next_purge = time.monotonic() + self._purge_delay()
                        await self.index.purge_dead_workers()
            except IndexUnavailableError:
                pass  # the link logged the state change; wait out its backoff
            except IncompatibleWorkerError as exc:
                log.error("worker %s stops publishing to the prefix index: %s", self.worker.worker_id, exc)
                self._disabled = True
            except Exception:  # a bug must not kill publishing silently
                log.exception("worker %s: prefix index publisher step failed", self.worker.worker_id)
            await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        """Sleep until there is something to send: queued events (then ``flush_interval_s`` more,
        to batch), the next heartbeat or purge, or the link's retry time. Idle, that is one
        wake-up per heartbeat, not one per flush interval."""
        pace = max(self.config.flush_interval_s, self.link.seconds_until_retry())
        self._wake.clear()  # before looking at the queue: a submit after this sets it again
        if self._queue or self._needs_resync or not self._registered:
            await asyncio.sleep(pace)
            return
        until = min(self._next_heartbeat, self._next_purge) - time.monotonic()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(pace, until))
        except asyncio.TimeoutError:
            return
        await asyncio.sleep(self.config.flush_interval_s)

    def _notify(self) -> None:
        """Any thread: wake the background task (events were queued)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to wake
                loop.call_soon_threadsafe(self._wake.set)

    async def _sync(self) -> None:
        """Bring Redis up to date: re-register if it may have lost us, heartbeat, flush events."""
        if self._disabled:
            return
        if self.link.reconnects != self._seen_reconnects and self._registered:
            self._seen_reconnects = self.link.reconnects
            if await self.link.server_run_id() != self._run_id:
                self._registered = False
        if not self._registered or self._needs_resync:
            await self._register()
        if time.monotonic() >= self._next_heartbeat:
            await self._heartbeat()
            if not self._registered:
                await self._register()
        await self._flush_queue()

    async def _register(self) -> None:
        """Check compatibility, write a fresh record and republish every held block."""
        spec = self.worker
        compat = PoolCompat(
            self.config.model_key, spec.block_size, spec.kv_cache_dtype, HASH_ALGORITHM_VERSION, spec.kv_storage_dtype
        )
        pool = await self.link.call(
            lambda: self.link.client.set(self.keys.compat, compat.to_json(), nx=True, get=True, px=self.config.ttl_ms),
            self.config.write_timeout_s,
        )
        if isinstance(pool, (str, bytes)):  # SET NX GET answers the pool's record, or None for a new pool
            compat.check_joins(PoolCompat.from_json(pool))
        run_id = await self.link.server_run_id()
        first = self._run_id is None
        by_op: dict[str, list[BlockHash]] = {}
        with self._lock:
            for block_hash, mediums in self._held.items():
                by_op.setdefault(_best_tier_op(mediums), []).append(block_hash)
            self._queue.clear()  # every queued event is already reflected in _held
            self._needs_resync = False
            load = self._load
        record = WorkerRecord(
            worker_id=spec.worker_id,
            role=spec.role,
            address=spec.address,
            generation=self.generation,
            total_blocks=spec.total_blocks,
            free_blocks=load.free_blocks,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            block_size=spec.block_size,
            kv_cache_dtype=spec.kv_cache_dtype,
            hash_algorithm_version=HASH_ALGORITHM_VERSION,
            started_at=self.started_at,
        )
        fields = [x for pair in record.to_fields().items() for x in pair]
        self._registered = False
        await self.link.call(
            lambda: self._register_script(
                keys=[
                    self.keys.registry,
                    self.keys.worker(spec.worker_id),
                    self.keys.wblocks(spec.worker_id),
                    self.keys.wtier(spec.worker_id),
                ],
                args=[self.keys.blk_prefix, spec.worker_id, self.generation, self.config.ttl_ms, *fields],
            ),
            self.config.write_timeout_s,
        )
        self._registered = True  # the fenced republish below needs the record just written
        try:
            for op, hashes in by_op.items():
                for start in range(0, len(hashes), REPUBLISH_CHUNK):
                    await self._apply((((op, tuple(hashes[start : start + REPUBLISH_CHUNK])),),))
        except IndexUnavailableError:
            self._registered = False
            raise
        if not self._registered:  # the record vanished again meanwhile; the next step retries
            return
        self._run_id = run_id
        self._seen_reconnects = self.link.reconnects
        self._next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
        if first:
            log.info(
                "worker %s (%s) joined the prefix index of %s, generation %s",
                spec.worker_id,
                spec.role,
                self.config.model_key,
                self.generation,
            )
        else:
            num_held = sum(len(hashes) for hashes in by_op.values())
            log.info("worker %s re-registered in the prefix index, %d blocks republished", spec.worker_id, num_held)

    async def _heartbeat(self) -> None:
        load = self._load
        state = await self.link.call(
            lambda: self._heartbeat_script(
                keys=[self.keys.worker(self.worker.worker_id), self.keys.compat],
                args=[
                    self.generation,
                    self.config.ttl_ms,
                    "free_blocks",
                    load.free_blocks,
                    "num_running",
                    load.num_running,
                    "num_waiting",
                    load.num_waiting,
                ],
            ),
            self.config.write_timeout_s,
        )
        self._next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
        self._on_record_state(state)

    async def _flush_queue(self) -> None:
        while self._registered and not self._disabled:
            with self._lock:
                if self._needs_resync:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.config.max_batch_events))]
            if not batch:
                return
            try:
                await self._apply(batch)
            except IndexUnavailableError:
                with self._lock:  # put the batch back in front; its commands are idempotent
                    self._queue.extendleft(reversed(batch))
                    overflow = len(self._queue) - self.config.max_buffered_events
                    if overflow > 0:
                        self._drop_oldest(overflow)
                raise

    async def _apply(self, batch: Iterable[_Update]) -> None:
        """Apply updates in one fenced script call (raises IndexUnavailableError)."""
        args: list[str] = [self.keys.blk_prefix, self.worker.worker_id, self.generation]
        for update in batch:
            for op, hashes in update:
                args += (op, b"".join(hashes).hex())
        if len(args) == 3:
            return
        worker_id = self.worker.worker_id
        keys = [self.keys.worker(worker_id), self.keys.wblocks(worker_id), self.keys.wtier(worker_id)]
        state = await self.link.call(lambda: self._apply_script(keys=keys, args=args), self.config.write_timeout_s)
        self._on_record_state(state)

    def _on_record_state(self, state: int) -> None:
        """React to what a fenced script found: 1 ok, 0 record gone, 2 superseded."""
        if state == 0 and self._registered:
            log.warning(
                "worker %s: record gone from the prefix index (expired or Redis restarted); re-registering",
                self.worker.worker_id,
            )
            self._registered = False
        elif state == 2 and not self._disabled:
            log.error(
                "worker %s: a newer start of this worker id took over the prefix index "
                "record; this process stops publishing",
                self.worker.worker_id,
            )
            self._disabled = True
            self._registered = False

    async def _deregister(self) -> None:
        await self._flush_queue()
        worker_id = self.worker.worker_id
        await self.link.call(
            lambda: self._deregister_script(
                keys=[
                    self.keys.registry,
                    self.keys.worker(worker_id),
                    self.keys.wblocks(worker_id),
                    self.keys.wtier(worker_id),
                ],
                args=[self.keys.blk_prefix, worker_id, self.generation],
            ),
            self.config.write_timeout_s,
        )
        self._registered = False
        log.info("worker %s left the prefix index", worker_id)

    # ---- helpers ----------------------------------------------------------------------------

    def _record(self, block_hashes: tuple[BlockHash, ...], bit: int, stored: bool) -> _Update:
        """Caller holds _lock. Add (stored) or remove one medium's bit for each hash in _held;
        return the best-tier changes, grouped by op (each hash in one group, so their order
        within the update does not matter)."""
        changed: dict[str, list[BlockHash]] = {}
        held = self._held
        for block_hash in block_hashes:
            old = held.get(block_hash, 0)
            new = old | bit if stored else old & ~bit
            if new == old:
                continue
            if new:
                held[block_hash] = new
            else:
                del held[block_hash]
            op = _best_tier_op(new)
            if op != _best_tier_op(old):
                changed.setdefault(op, []).append(block_hash)
        return tuple((op, tuple(hashes)) for op, hashes in changed.items())

    def _skip_unknown_medium(self, medium: str) -> None:
        """Caller holds _lock. An event of a medium outside MEDIUMS is an engine bug: skipped,
        logged once per medium, so the index never claims a tier nobody can load from."""
        if medium not in self._unknown_mediums:
            self._unknown_mediums.add(medium)
            log.error(
                "worker %s: block events for unknown medium %r (expected one of %s) are not indexed",
                self.worker.worker_id,
                medium,
                ", ".join(MEDIUMS),
            )

    def _drop_oldest(self, count: int) -> None:
        """Caller holds _lock. Dropped events are recovered by republishing the held set."""
        for _ in range(count):
            self._queue.popleft()
        if not self._needs_resync:
            log.warning(
                "worker %s: prefix index buffer full (%d events); dropping the oldest "
                "and republishing all held blocks once Redis answers",
                self.worker.worker_id,
                self.config.max_buffered_events,
            )
        self._dropped_events += count
        self._needs_resync = True

    def _purge_delay(self) -> float:
        # Jittered so that many workers do not sweep at the same moment.
        return self.config.purge_interval_s * random.uniform(0.5, 1.5)
