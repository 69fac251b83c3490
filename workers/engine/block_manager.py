"""Paged KV block accounting: ref counts, an LRU free queue, and the prefix cache.

Invariants (checked by ``check_idle``):
- A block is either referenced (ref_count > 0, held by one or more sequences' block tables) or
  in the free queue (ref_count == 0). Never both, never neither.
- A free block may still carry a hash: it is *cached* and can be revived by a prefix hit until
  the free queue hands it out again, which evicts it (``BlockRemoved``).
- ``hash -> block`` maps only full, computed blocks; every hit is verified against the block's
  token ids, so a hash collision can cost a miss but never a wrong answer.
- Only the block manager frees blocks. A sequence's blocks are freed exactly once, by ``free``.

Sliding-window models: a sequence drops its references to blocks that lie wholly before the
window of its next query (``drop_blocks_before``); their table entries become ``NULL_BLOCK`` so
that table index ``i`` still means tokens ``[i * block_size, (i + 1) * block_size)``. A dropped
block that is still cached stays revivable like any freed block.

The block manager emits ``BlockStored`` / ``BlockRemoved`` events and never imports Redis; the
worker drains them with ``take_events`` and hands them to the index publisher.

With tiers below it (``workers/engine/kv_tiers.py``): a cached block whose last reference goes is
offered down (copied to host memory / disk in the background), an evicted one is copied down
first if it was not yet, and ``start_load`` / ``finish_load`` bring a waiting sequence's blocks
back from a tier into free device blocks, held by the load (``LoadJob``) until it is done.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.hashing import ROOT_PARENT_HASH, BlockHash, hash_prompt_blocks
from workers.engine.kv_tiers import BlockMeta, KVTiers, LoadJob
from workers.engine.sequence import Sequence

NULL_BLOCK = -1  # a block table entry whose block was dropped (outside the sliding window)


def first_window_block(query_pos: int, window: int | None, block_size: int) -> int:
    """First block holding a key that a query at ``query_pos`` (or later) attends to: keys at
    ``query_pos - window < k <= query_pos``. 0 without a window."""
    if window is None:
        return 0
    return max(0, (query_pos - window + 1) // block_size)


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the tokens whose KV the block holds, kept for hit checks
    parent_hash: BlockHash = ROOT_PARENT_HASH  # with token_ids and cache_salt: what the hash is of
    cache_salt: str | None = None

    @property
    def meta(self) -> BlockMeta:
        assert self.block_hash is not None
        return BlockMeta(self.block_hash, self.parent_hash, self.token_ids, self.cache_salt)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """Leading blocks of a sequence found in the prefix cache (not yet referenced)."""

    blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0


@dataclass(slots=True)
class BlockStats:
    # Prefix-cache hits are counted by the scheduler, once per request (``Scheduler``).
    evictions: int = 0
    events: list[KVEvent] = field(default_factory=list)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_key: str,
        enable_prefix_caching: bool = True,
        tiers: KVTiers | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_key = model_key
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front is evicted first. Freed chains are appended tail-first, so a chain's last block
        # goes before its first: the shared head of many prompts survives longest.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.stats = BlockStats()
        self.tiers = tiers if enable_prefix_caching else None
        self.loads: list[LoadJob] = []  # tier loads under way; their blocks are referenced by them

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash this worker can serve (for republishing to a fresh index)."""
        return list(self._cached)

    def block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """The sequence's chained hashes over its full blocks, extended as it grows."""
        hashes = seq.block_hashes
        num_full = seq.num_tokens // self.block_size
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            hashes.extend(
                hash_prompt_blocks(
                    seq.token_ids[: num_full * self.block_size],
                    self.block_size,
                    self.model_key,
                    seq.cache_salt,
                    parent_hash=parent,
                    start_block=len(hashes),
                )
            )
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Longest run of the sequence's leading blocks held in the cache, verified by tokens.

        At least one token is always left to compute: the last prompt position's logits are
        needed to sample, and a block holds no logits. For the same reason a request asking for
        prompt logprobs takes no hit at all (as in vLLM); its own blocks are still cached.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return CachedPrefix()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(self.block_hashes(seq)[:max_blocks]):
            block = self._cached.get(block_hash)
            start = i * self.block_size
            if block is None or block.token_ids != tuple(seq.token_ids[start : start + self.block_size]):
                break
            hits.append(block)
        return CachedPrefix(tuple(hits), len(hits) * self.block_size)

    def find_in_tiers(self, seq: Sequence, cached: CachedPrefix) -> list[BlockMeta]:
        """The blocks right after ``cached`` that a lower tier holds (leading run, tokens
        verified), up to the last block before the sequence's last token."""
        if self.tiers is None or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        first = len(cached.blocks)
        if first >= max_blocks:
            return []
        hashes = self.block_hashes(seq)
        bs = self.block_size
        wanted = [(hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])) for i in range(first, max_blocks)]
        return self.tiers.find(wanted)

    def start_load(self, metas: list[BlockMeta], cached: CachedPrefix, reserve: int = 0) -> LoadJob | None:
        """Take free device blocks for ``metas`` (as many as are free beyond ``reserve``) and load
        them from the tiers in the background; the device-cached prefix before them (``cached``)
        is held by the load too, so that taking blocks cannot evict it. None when no block can be
        taken (nothing is held then)."""
        assert self.tiers is not None
        revived = sum(1 for b in cached.blocks if b.ref_count == 0)
        n = min(len(metas), len(self._free) - revived - reserve)
        if n <= 0:
            return None
        for block in cached.blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
        block_ids = []
        for _ in range(n):
            block = self._pop_free()
            block.ref_count = 1
            block_ids.append(block.block_id)
        job = self.tiers.load(metas[:n], block_ids)
        job.held = [b.block_id for b in cached.blocks]
        self.loads.append(job)
        return job

    def finish_loads(self) -> None:
        """Register the blocks of every finished load in the prefix cache (so the waiting
        sequence's lookup finds them) and drop the loads' references."""
        if not self.loads:
            return
        for job in [j for j in self.loads if j.done.is_set()]:
            self.loads.remove(job)
            stored: list[BlockHash] = []
            for i, (meta, block_id) in enumerate(zip(job.metas, job.block_ids)):
                if i >= job.loaded or meta.block_hash in self._cached:
                    continue  # not loaded; or computed meanwhile: the first copy stays
                block = self.blocks[block_id]
                block.block_hash, block.token_ids = meta.block_hash, meta.token_ids
                block.parent_hash, block.cache_salt = meta.parent_hash, meta.cache_salt
                self._cached[meta.block_hash] = block
                stored.append(meta.block_hash)
            if stored:
                self.stats.events.append(BlockStored(tuple(stored), job.metas[0].parent_hash))
            for block_id in reversed(job.held + job.block_ids):
                self._release(block_id)

    # ------------------------------------------------------------- allocation
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix = CachedPrefix()) -> bool:
        """Make ``seq.block_table`` cover its computed tokens, ``cached`` and ``num_new_tokens``.

        Either every block is taken or nothing changes (returns False): the scheduler then
        preempts or waits. ``cached`` blocks are referenced first so that the allocation cannot
        evict them.
        """
        num_tokens = seq.num_computed_tokens + cached.num_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached.blocks)
        num_revived = sum(1 for b in cached.blocks if b.ref_count == 0)
        if max(num_needed, 0) + num_revived > len(self._free):
            return False
        for block in cached.blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(max(num_needed, 0)):
            block = self._pop_free()
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_computed_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_computed_full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq)
        stored: list[BlockHash] = []
        first = -1
        for i in range(seq.num_cached_blocks, num_computed_full):
            if seq.block_table[i] == NULL_BLOCK:
                continue  # never held here (dropped before it was received): cannot be served
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue  # revived from the cache: already registered
            if hashes[i] in self._cached:
                continue  # computed twice concurrently: the first copy stays the cached one
            start = i * self.block_size
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
            block.parent_hash = hashes[i - 1] if i > 0 else ROOT_PARENT_HASH
            block.cache_salt = seq.cache_salt
            self._cached[hashes[i]] = block
            stored.append(hashes[i])
            first = i if first < 0 else first
        if stored:
            self.stats.events.append(BlockStored(tuple(stored), hashes[first - 1] if first > 0 else None))
        seq.num_cached_blocks = num_computed_full

    def share_blocks(self, seq: Sequence, num_blocks: int, other: Sequence) -> None:
        """``other``'s table references ``seq``'s first ``num_blocks`` blocks too."""
        for block_id in seq.block_table[:num_blocks]:
            if block_id != NULL_BLOCK:
                self.blocks[block_id].ref_count += 1
            other.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its cached blocks stay revivable until evicted."""
        for block_id in reversed(seq.block_table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        seq.block_table.clear()
        seq.num_cached_blocks = 0
        seq.num_dropped_blocks = 0

    def drop_blocks_before(self, seq: Sequence, first_block: int) -> None:
        """Sliding window: release the sequence's blocks before ``first_block``."""
        table = seq.block_table
        end = min(first_block, len(table))
        for i in range(seq.num_dropped_blocks, end):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, end)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = block
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing to keep: reuse first
            elif self.tiers is not None:
                self.tiers.offer(block_id, block.meta)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in every tier (only when no block is referenced)."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self._cached.clear()
        if self.tiers is not None:
            self.tiers.clear()
            self.tiers.take_events()  # superseded by the clear below
        self.stats.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.stats.events = self.stats.events, []
        if self.tiers is not None:
            events += self.tiers.take_events()
        return events

    def check_idle(self) -> None:
        """Raise if accounting is off while no sequence holds blocks (a leak or double free).
        Tier loads still under way (an aborted request's) are waited for and settled first."""
        if self.loads and self.tiers is not None:
            self.tiers.wait_idle()
            self.finish_loads()
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        if leaked or len(self._free) != self.num_blocks:
            raise AssertionError(
                f"block accounting: {len(self._free)} free of {self.num_blocks}, referenced while idle: {leaked[:16]}"
            )

    # --------------------------------------------------------------- internal
    def _pop_free(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self.tiers is not None:
                self.tiers.evict(block.block_id, block.meta)
            del self._cached[block.block_hash]
            self.stats.events.append(BlockRemoved((block.block_hash,)))
            self.stats.evictions += 1
            block.block_hash, block.token_ids = None, ()
        return block
