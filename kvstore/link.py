"""One process's connection to the index's Redis: deadlines, health state and reconnect backoff.

Every call goes through ``RedisLink.call``, which bounds it by a deadline and turns any Redis or
network failure into ``IndexUnavailableError`` after recording it: the first failure logs
"lost" once and starts a backoff (doubling, capped) during which calls fail at once without
touching the network; the first success after that logs "regained" once. Not thread-safe: use
a link from the one event loop that created it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError

from kvstore.config import IndexConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def _with_deadline(awaitable: Awaitable[T], timeout_s: float) -> T:
        async with asyncio.timeout(timeout_s):  # no extra task per call, unlike wait_for on 3.11
            return await awaitable
else:  # pragma: no cover

    async def _with_deadline(awaitable: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(awaitable, timeout_s)


class IndexUnavailableError(ConnectionError):
    """Redis did not answer within the deadline, refused, or the link is backing off."""


class IndexAuthError(IndexUnavailableError):
    """Redis refused the credentials in the URL: a configuration error, not a transient one."""


class RedisLink:
    def __init__(self, config: IndexConfig, name: str) -> None:
        self.config = config
        self.name = name  # who uses the link, for log lines ("publisher of worker w1", "router")
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            config.redis_url,
            decode_responses=True,
            socket_timeout=config.write_timeout_s,
            socket_connect_timeout=config.write_timeout_s,
            retry=Retry(NoBackoff(), 0),  # the deadline and our backoff decide, not hidden retries
            health_check_interval=0,
        )
        self._down_since: float | None = None
        self._backoff_s = config.reconnect_backoff_s
        self._retry_at = 0.0
        self.reconnects = 0  # times the link came back after being lost

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    @property
    def in_backoff(self) -> bool:
        return self._down_since is not None and time.monotonic() < self._retry_at

    def seconds_until_retry(self) -> float:
        return max(0.0, self._retry_at - time.monotonic()) if self.is_down else 0.0

    async def call(self, make_call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Run one Redis call under ``timeout_s``; raise IndexUnavailableError on any failure."""
        if self.in_backoff:
            raise IndexUnavailableError(f"Redis at {self.config.redis_url_redacted} is backing off")
        try:
            result = await _with_deadline(make_call(), timeout_s)
        except (AuthenticationError, AuthorizationError) as exc:
            self._mark_down(exc)
            raise IndexAuthError(
                f"Redis at {self.config.redis_url_redacted} refused the credentials in redis_url "
                f"({exc}): put the server's password in the URL as redis://:PASSWORD@host:port/db"
            ) from exc
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._mark_down(exc)
            if isinstance(exc, ResponseError) and not isinstance(exc, AuthenticationError):
                # A script or command error is a bug or a misconfigured server: say so loudly.
                log.error("%s: Redis replied with an error: %s", self.name, exc)
            raise IndexUnavailableError(f"Redis at {self.config.redis_url_redacted}: {exc!r}") from exc
        self._mark_up()
        return result

    async def ping(self) -> None:
        """Raise IndexAuthError for bad credentials, IndexUnavailableError if Redis is away."""
        await self.call(self.client.ping, self.config.write_timeout_s)

    async def server_run_id(self) -> str:
        """Changes whenever redis-server restarts: what was stored may be gone."""
        info = await self.call(lambda: self.client.info("server"), self.config.write_timeout_s)
        return str(info["run_id"])

    async def aclose(self) -> None:
        await self.client.aclose()

    def _mark_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._backoff_s = self.config.reconnect_backoff_s
            log.warning(
                "%s: Redis index at %s lost (%s: %s); retrying with backoff up to %.1fs",
                self.name,
                self.config.redis_url_redacted,
                type(exc).__name__,
                exc or "timeout",
                self.config.reconnect_backoff_max_s,
            )
        else:
            self._backoff_s = min(self._backoff_s * 2, self.config.reconnect_backoff_max_s)
        self._retry_at = now + self._backoff_s

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.info(
                "%s: Redis index at %s regained after %.1fs",
                self.name,
                self.config.redis_url_redacted,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
            self.reconnects += 1
