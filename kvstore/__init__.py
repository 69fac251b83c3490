"""Block hashing shared by the engine and the router, and the Redis prefix index.

This package imports no model code, no torch and no Ray: a router can hash a prompt's blocks
without loading a model.
"""

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.hashing import (
    HASH_ALGORITHM_VERSION,
    ROOT_PARENT_HASH,
    BlockHash,
    hash_block,
    hash_prompt_blocks,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "HASH_ALGORITHM_VERSION",
    "KVEvent",
    "ROOT_PARENT_HASH",
    "hash_block",
    "hash_prompt_blocks",
]
