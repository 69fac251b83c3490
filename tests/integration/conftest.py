"""Real redis-server fixtures (never mocks). Tests are skipped only when no redis-server binary
exists on this machine; they never touch a system Redis (each server gets a free port)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.redis_server import RedisServer, find_redis_server


def _require_redis_server() -> None:
    if find_redis_server() is None:
        pytest.skip("redis-server binary not found on PATH: install redis-server 7 to run these tests")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests that kill or reconfigure a server make their own."""
    _require_redis_server()
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session server, emptied before each test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    yield redis_server.url


@pytest.fixture
def make_redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Start a dedicated redis-server (e.g. to kill it, or with a password); stopped at teardown."""
    _require_redis_server()
    servers: list[RedisServer] = []

    def make(password: str | None = None) -> RedisServer:
        server = RedisServer(password=password)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
