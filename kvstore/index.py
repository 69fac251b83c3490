"""Read side of the Redis prefix index: which live worker holds how much of a prompt's prefix.

Used by routers (and by every publisher for the dead-worker sweep). Advisory by contract: a
method returns ``None`` when Redis is down, slow or backing off, and never raises for that; the
caller then routes by load alone. See ``kvstore.keys`` for the key layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore import lua
from kvstore.config import IndexConfig
from kvstore.hashing import HASH_NUM_BYTES, BlockHash
from kvstore.keys import IndexKeys
from kvstore.link import IndexAuthError, IndexUnavailableError, RedisLink
from kvstore.record import PrefixMatch, WorkerRecord

__all__ = ["PURGE_BLOCKS_PER_CALL", "PrefixIndex", "PrefixMatch"]

log = logging.getLogger(__name__)

PURGE_BLOCKS_PER_CALL = 2048  # bounds how long one purge script blocks Redis


class PrefixIndex:
    """Lookups over the index of one model. Coroutines for one event loop.

    ``start()`` checks credentials (raising ``IndexAuthError`` for a wrong password) but tolerates
    an unreachable Redis; ``close()`` releases the connection pool unless the link was injected.
    """

    def __init__(self, config: IndexConfig, link: RedisLink | None = None) -> None:
        self.config = config
        self.keys = IndexKeys(config.model_key)
        self._owns_link = link is None
        self.link = link if link is not None else RedisLink(config, name="prefix index")
        client = self.link.client
        self._longest_prefix = client.register_script(lua.LONGEST_PREFIX)
        self._live_workers = client.register_script(lua.LIVE_WORKERS)
        self._purge = client.register_script(lua.PURGE_DEAD_WORKERS)

    async def start(self) -> bool:
        """Connect once; True if Redis answered. Raises IndexAuthError for bad credentials."""
        try:
            await self.link.ping()
        except IndexAuthError:
            raise
        except IndexUnavailableError:
            return False
        return True

    async def close(self) -> None:
        if self._owns_link:
            await self.link.aclose()

    async def longest_prefix(self, block_hashes: Sequence[BlockHash], role: str | None = None) -> dict[str, int] | None:
        """For every live worker (of ``role`` if given): how many leading blocks of the chain
        ``block_hashes`` it holds in any tier, 0 included. One round trip. None: no information
        (Redis away).
        """
        flat = await self._lookup(block_hashes, role, count_tiers=False)
        if flat is None:
            return None
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 4)}

    async def prefix_matches(
        self, block_hashes: Sequence[BlockHash], role: str | None = None
    ) -> dict[str, PrefixMatch] | None:
        """Like ``longest_prefix``, with how many of each worker's leading blocks are on host or
        disk (best tier). One round trip. None: no information (Redis away)."""
        flat = await self._lookup(block_hashes, role, count_tiers=True)
        if flat is None:
            return None
        return {
            flat[i]: PrefixMatch(int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])) for i in range(0, len(flat), 4)
        }

    async def _lookup(self, block_hashes: Sequence[BlockHash], role: str | None, count_tiers: bool) -> list | None:
        chain = b"".join(block_hashes)
        if len(chain) != HASH_NUM_BYTES * len(block_hashes):  # the script reads fixed-width hashes
            raise ValueError(f"block hashes must be {HASH_NUM_BYTES} bytes each (kvstore.hashing)")
        keys = (self.keys.registry,)
        args = (
            self.keys.worker_prefix,
            role or "",
            self.keys.blk_prefix,
            chain.hex(),
            self.keys.wblocks_prefix,
            self.keys.wtier_prefix if count_tiers else "",
        )
        try:
            return await self.link.call(
                lambda: self._longest_prefix(keys=keys, args=args), self.config.lookup_timeout_s
            )
        except IndexUnavailableError:
            return None

    async def live_workers(self, role: str | None = None) -> dict[str, WorkerRecord] | None:
        """Every worker with a live record (of ``role`` if given), or None if Redis is away."""
        try:
            flat = await self.link.call(
                lambda: self._live_workers(keys=[self.keys.registry], args=[self.keys.worker_prefix]),
                self.config.lookup_timeout_s,
            )
        except IndexUnavailableError:
            return None
        records = {}
        for i in range(0, len(flat), 2):
            fields = flat[i + 1]
            record = WorkerRecord.from_fields(flat[i], dict(zip(fields[::2], fields[1::2])))
            if role is None or record.role == role:
                records[record.worker_id] = record
        return records

    async def purge_dead_workers(self) -> list[str] | None:
        """Remove the block entries of every registered worker whose record expired.

        Only entries still carrying the dead generation are removed. Safe to run from many
        processes at once (members are popped atomically). Returns the ids fully purged by this
        call, or None if Redis went away midway (the next sweep continues where this one stopped).
        """
        purged: list[str] = []
        removed: dict[str, int] = {}
        more = True
        while more:
            try:
                reply = await self.link.call(
                    lambda: self._purge(keys=[self.keys.registry], args=[self.keys.prefix, PURGE_BLOCKS_PER_CALL]),
                    self.config.write_timeout_s,
                )
            except IndexUnavailableError:
                return None
            more = reply[0] == 1
            for i in range(1, len(reply), 4):
                worker_id, generation, count, done = reply[i : i + 4]
                removed[worker_id] = removed.get(worker_id, 0) + int(count)
                if done == 1:
                    purged.append(worker_id)
                    log.info(
                        "worker %s (generation %s) purged from the prefix index of %s: %d block entries removed",
                        worker_id,
                        generation,
                        self.config.model_key,
                        removed[worker_id],
                    )
        return purged
