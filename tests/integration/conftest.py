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


# ---------------------------------------------------------------- Ray Serve application
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import httpx  # noqa: E402

from tests.redis_server import free_port  # noqa: E402


@dataclass
class ServeCluster:
    http_port: int
    redis: RedisServer
    metrics_port: int
    dashboard_url: str  # the Ray dashboard (the pd autoscaler scales the pools through its REST API)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.http_port}{route_prefix}"


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    """A local Ray with Serve on a free HTTP port, and a redis-server of its own for the index."""
    _require_redis_server()
    import ray
    from ray import serve

    redis_server = RedisServer()
    redis_server.start()
    port, metrics_port, dashboard_port = free_port(), free_port(), free_port()
    try:
        ray.init(
            num_cpus=8,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            log_to_driver=False,
            _metrics_export_port=metrics_port,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:
        redis_server.stop()  # never orphan the redis-server when Ray fails to start
        raise
    yield ServeCluster(port, redis_server, metrics_port, f"http://127.0.0.1:{dashboard_port}")
    serve.shutdown()
    ray.shutdown()
    redis_server.stop()


def deploy(cluster: ServeCluster, name: str, route_prefix: str, args: dict) -> str:
    """Deploy build_app(args) as application ``name``; return its base URL once it answers.
    Attention is the sdpa backend unless `args` names one: the paged kernel compiles in every
    replica at start-up (~3 s each with inductor's cache warm), which the serving tests do not
    exercise; tests/unit/test_paged_decode.py covers it, and test_real_model_serve serves on auto."""
    from deploy.builder import deploy_and_wait

    args = {"attention_backend": "sdpa", **args}

    return deploy_and_wait(args, name, route_prefix, cluster.url(route_prefix if route_prefix != "/" else ""))


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 0.5 s until it holds; fail saying `what` did not happen in time."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f}s")


def wait_idle(base: str, timeout_s: float = 30.0, headers: dict | None = None) -> dict:
    """Poll /v1/cluster/status until no replica holds a referenced block; return the status."""
    deadline = time.time() + timeout_s
    status = {}
    while time.time() < deadline:
        status = httpx.get(f"{base}/v1/cluster/status", timeout=10, headers=headers).json()
        replicas = [r for pool in status["pools"].values() for r in pool]
        records = (status["index"].get("workers") or {}) if status["index"].get("healthy") else {}

        def idle(r: dict, records: dict = records) -> bool:
            if r.get("healthy"):
                return r["free_blocks"] == r["total_blocks"]
            # A replica the ingress's router cannot reach yet (just replaced): its own record in
            # the index, refreshed by its heartbeat, must show every block free.
            record = records.get(r["worker_id"])
            return record is not None and record["free_blocks"] == record["total_blocks"]

        if replicas and all(idle(r) for r in replicas):
            return status
        time.sleep(0.2)
    raise AssertionError(f"blocks still referenced after {timeout_s}s: {status}")
