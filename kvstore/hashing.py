"""Chained block hashes, identical in every process and every version with the same inputs.

    H_i = SHA-256(parent || u32(len(model_key)) || model_key || u32(len(salt)) || salt
                  || token_ids as little-endian int32)[:16]

with parent = H_{i-1} and, for the first block, ``ROOT_PARENT_HASH``. Lengths are prefixed so
that (model_key, salt) pairs cannot collide by concatenation. Only *full* blocks are hashed: a
partial block is never shared. No Python ``hash()`` and no per-process seed are involved, so a
router and any worker agree on a prompt's hashes without talking to each other.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

HASH_ALGORITHM_VERSION = 1
HASH_NUM_BYTES = 16
ROOT_PARENT_HASH: BlockHash = hashlib.sha256(b"pdserve/block-hash/root/v1").digest()[:HASH_NUM_BYTES]

_U32 = struct.Struct("<I")


def _int32_le(token_ids: Sequence[int]) -> bytes:
    buf = array("i", token_ids)  # raises OverflowError for ids outside int32
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def _scope_bytes(model_key: str, cache_salt: str | None) -> bytes:
    key = model_key.encode()
    salt = (cache_salt or "").encode()
    return _U32.pack(len(key)) + key + _U32.pack(len(salt)) + salt


def hash_block(
    parent_hash: BlockHash, token_ids: Sequence[int], model_key: str, cache_salt: str | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = hashlib.sha256(parent_hash)
    h.update(_scope_bytes(model_key, cache_salt))
    h.update(_int32_le(token_ids))
    return h.digest()[:HASH_NUM_BYTES]


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_key: str,
    cache_salt: str | None = None,
    parent_hash: BlockHash = ROOT_PARENT_HASH,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` must be the hash of block ``start_block - 1`` (or the root for block 0); this
    lets a sequence extend its chain as it grows without rehashing what it already hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    scope = _scope_bytes(model_key, cache_salt)
    hashes: list[BlockHash] = []
    parent = parent_hash
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(scope)
        h.update(_int32_le(token_ids[start : start + block_size]))
        parent = h.digest()[:HASH_NUM_BYTES]
        hashes.append(parent)
    return hashes
