"""Block events: what a worker's block manager tells the rest of the cluster.

The block manager emits these and never imports Redis; the index client (``kvstore.index``)
consumes them in batches off the hot path. Names follow vLLM's KV events, ``medium`` included:
a block may be held in several tiers at once (a host copy of a device block); each event adds or
removes the block in one tier, and a holder is indexed under the best tier that still holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hashing import BlockHash

DEVICE, HOST, DISK = "device", "host", "disk"
MEDIUMS = (DEVICE, HOST, DISK)  # best first: the order a lookup prefers and a block falls through


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose KV became reusable (computed or received), in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None  # hash of the block before block_hashes[0]; None for a chain root
    medium: str = DEVICE  # the tier that now holds them (MEDIUMS)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks whose cached KV was evicted from ``medium``: that tier no longer answers for them."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = DEVICE  # the tier that no longer holds them; others may still


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache, every tier (reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
