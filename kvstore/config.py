"""Frozen configs of the Redis prefix index: where Redis is and how patient to be with it."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

WORKER_ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class IndexConfig:
    """How one process talks to the index. Every duration is in seconds.

    The index is advisory: every Redis call is bounded by ``lookup_timeout_s`` (lookups,
    heartbeats) or ``write_timeout_s`` (batched publishes, purges, resyncs), and a failed call
    puts the link into backoff instead of raising into the caller.
    """

    redis_url: str  # redis://[:password@]host:port/db or rediss://...
    model_key: str  # namespaces every key: pd:{model_key}:...
    heartbeat_interval_s: float = 1.0
    ttl_s: float = 3.0  # a worker record expires this long after its last heartbeat
    lookup_timeout_s: float = 0.05
    write_timeout_s: float = 2.0
    max_buffered_events: int = 10_000  # beyond this the oldest buffered event is dropped
    max_batch_events: int = 256  # events applied per pipeline
    flush_interval_s: float = 0.01  # how long events may wait to be batched
    purge_interval_s: float = 5.0  # how often a live publisher sweeps dead workers
    reconnect_backoff_s: float = 0.05  # first wait after Redis is lost; doubles per failure
    reconnect_backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        scheme = urlsplit(self.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis_url {self.redis_url_redacted!r} has scheme {scheme!r}: "
                "use redis://host:port/db or rediss://host:port/db"
            )
        if not self.model_key or any(c in self.model_key for c in "{}"):
            raise ValueError(
                f"model_key {self.model_key!r} must be non-empty and contain no braces "
                "(they delimit the Redis Cluster hash tag)"
            )
        positive = (
            "heartbeat_interval_s",
            "ttl_s",
            "lookup_timeout_s",
            "write_timeout_s",
            "flush_interval_s",
            "purge_interval_s",
            "reconnect_backoff_s",
            "reconnect_backoff_max_s",
            "max_buffered_events",
            "max_batch_events",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"ttl_s {self.ttl_s} must exceed heartbeat_interval_s {self.heartbeat_interval_s} "
                "(3x is usual), or live workers expire between heartbeats"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def redis_url_redacted(self) -> str:
        """The URL without its password, for logs and error messages."""
        parts = urlsplit(self.redis_url)
        if parts.password is None:
            return self.redis_url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return parts._replace(netloc=user + netloc).geturl()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is, fixed for its lifetime; registered with every (re)start."""

    worker_id: str
    role: str  # one of WORKER_ROLES
    address: str  # how peers reach it (replica id, host:port, ...)
    total_blocks: int
    block_size: int
    kv_cache_dtype: str  # the option (auto, int8, fp8)
    kv_storage_dtype: str = ""  # what the cache stores: the pool's workers must agree on both

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(WORKER_ROLES)}")
        if self.total_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"total_blocks ({self.total_blocks}) and block_size ({self.block_size}) must be positive")
