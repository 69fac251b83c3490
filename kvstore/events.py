"""Block events: what a worker's block manager tells the rest of the cluster.

The block manager emits these and never imports Redis; the index client (``kvstore.index``)
consumes them in batches off the hot path. Names follow vLLM's KV events.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose KV became reusable (computed or received), in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None  # hash of the block before block_hashes[0]; None for a chain root


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks whose cached KV was evicted: they no longer answer prefix lookups."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
