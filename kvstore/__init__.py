"""Block hashing shared by the engine and the router, and the Redis prefix index.

This package imports no model code, no torch and no Ray: a router can hash a prompt's blocks
without loading a model.
"""

from typing import TYPE_CHECKING, Any

from kvstore.compat import IncompatibleWorkerError, PoolCompat
from kvstore.config import IndexConfig, WorkerSpec
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.hashing import (
    HASH_ALGORITHM_VERSION,
    ROOT_PARENT_HASH,
    BlockHash,
    hash_block,
    hash_prompt_blocks,
)
from kvstore.keys import IndexKeys
from kvstore.record import WorkerLoad, WorkerRecord

if TYPE_CHECKING:
    from kvstore.index import PrefixIndex
    from kvstore.link import IndexAuthError, IndexUnavailableError
    from kvstore.publisher import IndexPublisher

# These import redis-py, so they load on first use: the engine imports kvstore.hashing and
# must not pull in Redis.
_REDIS_EXPORTS = {
    "PrefixIndex": "kvstore.index",
    "IndexPublisher": "kvstore.publisher",
    "IndexAuthError": "kvstore.link",
    "IndexUnavailableError": "kvstore.link",
}


def __getattr__(name: str) -> Any:
    if name in _REDIS_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_REDIS_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "HASH_ALGORITHM_VERSION",
    "hash_block",
    "hash_prompt_blocks",
    "IncompatibleWorkerError",
    "IndexAuthError",
    "IndexConfig",
    "IndexKeys",
    "IndexPublisher",
    "IndexUnavailableError",
    "KVEvent",
    "PoolCompat",
    "PrefixIndex",
    "ROOT_PARENT_HASH",
    "WorkerLoad",
    "WorkerRecord",
    "WorkerSpec",
]
