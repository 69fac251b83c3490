"""Token ids of finished chat turns, kept so that a conversation's next turn reuses its KV.

A chat's next turn arrives as message *text*; re-tokenizing an answer's text rarely gives back
the ids the model generated, so the block-hash chain would break at the first answer and its
blocks (and everything after them) would never be reused. The ingress therefore records each
finished turn's ids (prompt + answer) under a digest of the text the client sends back (the
rendered prompt + the answer text exactly as returned); a later turn whose rendered prompt
starts with that text is tokenized as the recorded ids + the rest (``deploy.api.conversation``).

Two stores with one interface: ``RedisConversationStore`` (shared by every ingress replica, keys
``pd:{model_key}:conv:<hex digest>`` with a TTL) and ``LocalConversationStore`` (a bounded
in-process LRU, for deployments without Redis). Both are advisory like the prefix index: an
entry that is missing, expired or unreachable costs a cache miss, never a failed request.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import struct
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.config import IndexConfig
from kvstore.keys import IndexKeys

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class ConversationConfig:
    """Limits of a conversation store. Durations in seconds."""

    ttl_s: float = 3600.0  # an entry lives this long after the turn that wrote it
    max_entry_tokens: int = 131_072  # longer conversations are not recorded (512 KiB of int32)
    local_max_entries: int = 4096  # in-process store: entries kept at most (LRU)
    local_max_tokens: int = 4_000_000  # in-process store: token ids kept at most, all entries (16 MB)
    get_timeout_s: float = 0.25
    put_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        for name in (
            "ttl_s",
            "max_entry_tokens",
            "local_max_entries",
            "local_max_tokens",
            "get_timeout_s",
            "put_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ConversationConfig.{name} must be positive, got {getattr(self, name)}")


def conversation_key(model_key: str, cache_salt: str | None, text: str) -> bytes:
    """Digest naming one recorded turn: the model, the tenant's salt and the turn's full text
    (length-prefixed, so no two (model, salt, text) triples share a digest by concatenation)."""
    h = hashlib.sha256(b"pdserve/conversation/v1")
    for part in (model_key, cache_salt or "", text):
        data = part.encode("utf-8", "surrogatepass")
        h.update(_U32.pack(len(data)))
        h.update(data)
    return h.digest()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    buf = array("i", token_ids)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    buf = array("i")
    buf.frombytes(data)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tolist()


class ConversationStore(Protocol):
    """Where recorded turns live. Coroutines for one event loop; never raise for a store outage."""

    async def get_many(self, keys: Sequence[bytes]) -> list[list[int] | None]:
        """The recorded token ids of each key (None: not recorded, expired, or store away)."""
        ...

    async def put(self, key: bytes, token_ids: Sequence[int]) -> bool:
        """Record a turn; False when it was not kept (too long, or the store is away)."""
        ...

    async def close(self) -> None: ...


class LocalConversationStore:
    """A bounded in-process LRU with the same TTL as the Redis store. One event loop only."""

    def __init__(
        self, config: ConversationConfig = ConversationConfig(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()  # key -> (expiry, ids)
        self._num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    async def get_many(self, keys: Sequence[bytes]) -> list[list[int] | None]:
        now = self._clock()
        found: list[list[int] | None] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry[0] <= now:
                self._drop(key)
                entry = None
            if entry is not None:
                self._entries.move_to_end(key)
            found.append(None if entry is None else unpack_token_ids(entry[1]))
        return found

    async def put(self, key: bytes, token_ids: Sequence[int]) -> bool:
        cfg = self.config
        if len(token_ids) > min(cfg.max_entry_tokens, cfg.local_max_tokens):
            return False
        self._drop(key)
        self._entries[key] = (self._clock() + cfg.ttl_s, pack_token_ids(token_ids))
        self._num_tokens += len(token_ids)
        while len(self._entries) > cfg.local_max_entries or self._num_tokens > cfg.local_max_tokens:
            self._drop(next(iter(self._entries)))  # least recently used first
        return True

    async def close(self) -> None:
        self._entries.clear()
        self._num_tokens = 0

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._num_tokens -= len(entry[1]) // 4


class RedisConversationStore:
    """Recorded turns in the prefix index's Redis, under the model's hash tag; values are the
    token ids as base64 little-endian int32, each with the config's TTL."""

    def __init__(self, index_config: IndexConfig, config: ConversationConfig = ConversationConfig(), link=None) -> None:
        from kvstore.link import RedisLink  # imports redis-py

        self.config = config
        self.prefix = IndexKeys(index_config.model_key).prefix + "conv:"
        self._owns_link = link is None
        self.link = link if link is not None else RedisLink(index_config, name="conversation store")

    def redis_key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    async def get_many(self, keys: Sequence[bytes]) -> list[list[int] | None]:
        from kvstore.link import IndexUnavailableError

        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        try:
            values = await self.link.call(lambda: self.link.client.mget(names), self.config.get_timeout_s)
        except IndexUnavailableError:
            return [None] * len(keys)
        return [None if v is None else unpack_token_ids(base64.b64decode(v)) for v in values]

    async def put(self, key: bytes, token_ids: Sequence[int]) -> bool:
        from kvstore.link import IndexUnavailableError

        if len(token_ids) > self.config.max_entry_tokens:
            return False
        value = base64.b64encode(pack_token_ids(token_ids)).decode("ascii")
        ttl_ms = max(1, round(self.config.ttl_s * 1000))
        try:
            await self.link.call(
                lambda: self.link.client.set(self.redis_key(key), value, px=ttl_ms), self.config.put_timeout_s
            )
        except IndexUnavailableError:
            return False
        return True

    async def close(self) -> None:
        if self._owns_link:
            await self.link.aclose()
