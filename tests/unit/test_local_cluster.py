"""The local launcher starts a managed redis-server only when no Redis is given, never on 6379,
and stops exactly what it started. Ray is left out (start_ray=False) to keep this fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.local import (
    HAPROXY_ENV,
    RAY_DEFAULT_GCS_PORT,
    SERVE_PERIODS_ENV,
    LocalCluster,
    find_free_port,
    redact_url,
    serve_periods_env,
    wait_for_redis,
)
from tests.redis_server import RedisServer, find_redis_server

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")

REPO_ROOT = Path(__file__).resolve().parents[2]


# A process that starts a LocalCluster (Redis only), prints the managed redis-server's pid, and waits.
LAUNCHER_SCRIPT = textwrap.dedent("""
    import time
    from cluster.local import LocalCluster
    cluster = LocalCluster(start_ray=False).start()
    print(cluster.redis_pid, flush=True)
    time.sleep(60)
""")


def start_launcher() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_managed_redis_answers_then_is_gone_after_stop() -> None:
    cluster = LocalCluster(start_ray=False).start()
    try:
        assert cluster.started_redis and not cluster.started_ray
        url = cluster.redis_url
        assert url is not None and url.startswith("redis://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert port != RAY_DEFAULT_GCS_PORT
        wait_for_redis(url, timeout_s=2.0)
        pid = cluster.redis_pid
        assert pid is not None and _pid_alive(pid)
    finally:
        cluster.stop()
    assert not cluster.started_redis and cluster.redis_url is None
    assert not _pid_alive(pid)
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        wait_for_redis(url, timeout_s=0.2)
    cluster.stop()  # idempotent


def test_given_redis_url_is_used_as_is_and_left_running() -> None:
    with RedisServer() as server:
        with LocalCluster(redis_url=server.url, start_ray=False) as cluster:
            assert cluster.redis_url == server.url
            assert not cluster.started_redis and cluster.redis_pid is None
        assert server.running  # stop() leaves alone what it did not start
        wait_for_redis(server.url, timeout_s=2.0)


def test_explicit_redis_port_is_used_and_6379_refused() -> None:
    port = find_free_port()
    with LocalCluster(redis_port=port, start_ray=False) as cluster:
        assert cluster.redis_url == f"redis://127.0.0.1:{port}/0"
    with pytest.raises(ValueError, match="GCS"):
        LocalCluster(redis_port=RAY_DEFAULT_GCS_PORT, start_ray=False)
    with pytest.raises(ValueError, match="not both"):
        LocalCluster(redis_url="redis://127.0.0.1:1/0", redis_port=port, start_ray=False)


def test_find_free_port_honours_exclude() -> None:
    taken = find_free_port()
    assert find_free_port(exclude={RAY_DEFAULT_GCS_PORT, taken}) not in {RAY_DEFAULT_GCS_PORT, taken}


def test_serve_periods_env_adds_what_is_unset_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment a started Ray inherits carries Serve's periods; an operator's own value
    wins, and afterwards the environment is as it was."""
    (mine, other) = list(SERVE_PERIODS_ENV)
    monkeypatch.setenv(mine, "2.5")
    monkeypatch.delenv(other, raising=False)
    with serve_periods_env() as added:
        assert added == {other: SERVE_PERIODS_ENV[other]}
        assert os.environ[mine] == "2.5" and os.environ[other] == SERVE_PERIODS_ENV[other]
    assert os.environ[mine] == "2.5" and other not in os.environ


def test_serve_periods_env_adds_haproxy_switch_only_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--haproxy` adds Serve's HAProxy switch and drain period beside the periods; an operator's
    own drain period wins, and afterwards both are gone."""
    (switch, drain) = list(HAPROXY_ENV)
    monkeypatch.delenv(switch, raising=False)
    monkeypatch.setenv(drain, "7")
    with serve_periods_env(HAPROXY_ENV) as added:
        assert added[switch] == "1" and drain not in added
        assert os.environ[switch] == "1" and os.environ[drain] == "7"
    assert switch not in os.environ and os.environ[drain] == "7"


def test_haproxy_with_an_existing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing cluster's Serve reads its HAProxy switch from its own `ray start`: asking for
    it here would be silently ignored, so it is refused, saying where to set it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        LocalCluster(ray_address="10.0.0.1:6379", haproxy=True)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ValueError, match="existing cluster"):
        LocalCluster(haproxy=True)
    assert LocalCluster(haproxy=False)._ray_address == "10.0.0.1:6379"


def test_redact_url_hides_password() -> None:
    assert redact_url("redis://:s3cret@10.0.0.1:6380/0") == "redis://:***@10.0.0.1:6380/0"
    assert redact_url("redis://127.0.0.1:6380/0") == "redis://127.0.0.1:6380/0"


def test_sigterm_stops_managed_redis(tmp_path: Path) -> None:
    """A launcher process killed by SIGTERM leaves no redis-server behind."""
    proc = start_launcher()
    try:
        assert proc.stdout is not None
        redis_pid = int(proc.stdout.readline())
        assert _pid_alive(redis_pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _pid_alive(redis_pid)


def test_ray_config_env_names_each_setting_as_ray_reads_it_from_the_environment() -> None:
    from cluster.local import RAY_IDLE_CONFIG, ray_config_env

    env = ray_config_env()
    assert set(env) == {f"RAY_{name}" for name in RAY_IDLE_CONFIG}
    assert env["RAY_event_stats"] == "0"  # Ray reads a boolean as true only from "1" or "true"
    assert env["RAY_kill_idle_workers_interval_ms"] == "1000"
