"""`pdserve up`'s start and stop, the parts that need no Ray: /health's state machine, the
managed redis-server out of the terminal's process group (a Ctrl-C must not kill the index
before the replicas leave it) and stopped after Ray, the two-step Ctrl-C, Serve's logging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster.local import LocalCluster, wait_for_redis
from deploy.pools.worker_calls import PoolReadiness
from tests.redis_server import find_redis_server
from tests.unit.test_local_cluster import start_launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


# ------------------------------------------------------------------ /health
class _Method:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool

    def remote(self):
        return self.pool.answer()


class _Pool:
    """A handle whose `stats` call waits until `up` is set (no replica yet), or fails first."""

    def __init__(self, failures: int = 0) -> None:
        self.up = asyncio.Event()
        self.failures = failures
        self.calls = 0
        self.stats = _Method(self)

    async def answer(self) -> dict:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("no replica yet")
        await self.up.wait()
        return {"worker_id": "r1"}


def test_health_is_starting_until_every_pool_answers_then_ok():
    async def main():
        prefill, decode = _Pool(), _Pool(failures=2)
        readiness = PoolReadiness({"prefill": prefill, "decode": decode, "colocated": None}, retry_s=0.01)
        first = readiness.status()  # answers at once, and starts the probe
        assert first == {"status": "starting", "pools": {"prefill": "starting", "decode": "starting"}}
        prefill.up.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
        assert readiness.status()["pools"] == {"prefill": "ready", "decode": "starting"}
        decode.up.set()
        for _ in range(200):
            if readiness.is_ready:
                break
            await asyncio.sleep(0.01)
        assert readiness.status() == {"status": "ok"}
        assert decode.calls >= 3  # its failed probes were retried
        calls = prefill.calls, decode.calls
        assert readiness.status() == {"status": "ok"}  # ok for good: no probing any more
        assert (prefill.calls, decode.calls) == calls
        readiness.stopping = True  # the ingress drains before a stop
        assert readiness.status() == {"status": "stopping"}

    asyncio.run(main())


def test_a_probe_that_times_out_is_tried_again():
    async def main():
        pool = _Pool()
        readiness = PoolReadiness({"colocated": pool}, probe_timeout_s=0.05, retry_s=0.01)
        readiness.status()
        await asyncio.sleep(0.3)
        assert pool.calls >= 2 and not readiness.is_ready
        pool.up.set()
        for _ in range(100):
            if readiness.is_ready:
                break
            await asyncio.sleep(0.01)
        assert readiness.status() == {"status": "ok"}

    asyncio.run(main())


# ------------------------------------------------------------------ the managed redis-server
@needs_redis
def test_managed_redis_runs_in_its_own_session_and_process_group():
    phases: list[str] = []
    with LocalCluster(start_ray=False, on_phase=phases.append) as cluster:
        pid = cluster.redis_pid
        assert pid is not None
        assert os.getpgid(pid) != os.getpgid(0)  # a terminal's Ctrl-C goes to our group, not its
        assert os.getsid(pid) != os.getsid(0)
    assert _wait_gone(pid)  # stop() still stops it
    assert phases[0].startswith("Redis started: managed redis-server") and str(pid) in phases[0]
    assert phases[-1].startswith("Redis stopped")


@needs_redis
def test_sigint_to_the_launchers_group_leaves_redis_up_until_stop():
    """As a terminal's Ctrl-C: SIGINT to the launcher's whole process group. The launcher (like
    `pdserve up`) takes SIGINT as "stop in order"; redis-server must not die of it meanwhile."""
    script = textwrap.dedent("""
        import signal, sys, time
        from cluster.local import LocalCluster
        got = []
        signal.signal(signal.SIGINT, lambda *_: got.append(1))  # no Event: set() in a handler can deadlock
        cluster = LocalCluster(start_ray=False).start()
        print(cluster.redis_pid, cluster.redis_url, flush=True)
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        print("sigint", flush=True)
        sys.stdin.readline()  # the test checks Redis meanwhile
        cluster.stop()
        print("stopped", flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pid_text, url = proc.stdout.readline().split()
        redis_pid = int(pid_text)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stdout.readline().strip() == "sigint"
        assert _alive(redis_pid)
        wait_for_redis(url, timeout_s=2.0)  # still answering after the group's SIGINT
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "stopped"
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _wait_gone(redis_pid)


@needs_redis
def test_redis_does_not_outlive_a_sigkilled_launcher():
    """Out of our process group, a group kill no longer reaches it: the parent-death signal does."""
    proc = start_launcher()
    try:
        redis_pid = int(proc.stdout.readline())
        assert _alive(redis_pid)
        proc.kill()  # no atexit, no handler
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _wait_gone(redis_pid), "redis-server outlived its SIGKILLed launcher"


@needs_redis
def test_stop_ends_ray_before_redis(monkeypatch):
    """Replicas may still talk to the index while Ray stops: Redis must outlive Ray."""
    import ray

    cluster = LocalCluster(start_ray=False).start()
    url = cluster.redis_url
    seen: list[bool] = []

    def shutdown() -> None:
        try:
            wait_for_redis(url, timeout_s=1.0)
            seen.append(True)
        except TimeoutError:
            seen.append(False)

    monkeypatch.setattr(ray, "shutdown", shutdown)
    cluster._ray_initialized_here = True  # as if start() had connected to a Ray
    cluster.stop()
    assert seen == [True]
    assert cluster.redis_pid is None


@needs_redis
def test_kill_stops_redis_at_once():
    cluster = LocalCluster(start_ray=False).start()
    pid = cluster.redis_pid
    directory = cluster._redis_dir
    cluster.kill()
    assert _wait_gone(pid, timeout_s=5.0)
    assert directory is not None and not directory.exists()
    cluster.stop()  # nothing left to do, and no error


# ------------------------------------------------------------------ the two-step Ctrl-C
def test_the_stop_flag_waits_like_an_event():
    from deploy.ops.cli import _StopFlag

    flag = _StopFlag()
    assert not flag.is_set() and flag.wait(0.05) is False and flag.wait(-1) is False
    flag.set()
    assert flag.is_set() and flag.wait() is True and flag.wait(0) is True


def test_the_stop_flag_sleeps_until_set_from_another_thread():
    import threading

    from bench.idle import thread_switches
    from deploy.ops.cli import _StopFlag

    flag = _StopFlag()
    waiter: dict[str, object] = {}
    returned = threading.Event()

    def wait() -> None:
        waiter["tid"] = threading.get_native_id()
        waiter["result"] = flag.wait()
        returned.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    while "tid" not in waiter:
        time.sleep(0.01)
    tid = str(waiter["tid"])
    time.sleep(0.2)  # into select
    before = thread_switches("self")[tid]
    time.sleep(1.0)
    # Asleep in select: it did not wake (a 0.1 s poll woke ten times over that second).
    assert thread_switches("self")[tid] - before <= 2 and not returned.is_set()
    flag.set()
    assert returned.wait(10) and waiter["result"] is True


def test_first_interrupt_asks_for_a_stop_a_second_one_exits_at_once():
    script = textwrap.dedent("""
        import sys, time
        from deploy.ops.cli import _StopSignals
        signals = _StopSignals()
        signals.on_force = lambda: print("forced", flush=True)
        signals.install()
        print("ready", flush=True)
        signals.stop.wait(60)
        print("stopping", flush=True)
        time.sleep(60)  # a slow stop: the second Ctrl-C must not wait for it
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stdout.readline().strip() == "stopping"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "forced" in out
    assert "stopping at once" in err and "Traceback" not in err


# ------------------------------------------------------------------ Serve's logging
def test_serve_access_log_is_off_unless_asked_for():
    from deploy.builder import serve_logging

    default = serve_logging("INFO")
    assert default.enable_access_log is False and default.log_level == "WARNING"
    asked = serve_logging("INFO", access_log=True)
    assert asked.enable_access_log is True and asked.log_level == "INFO"  # access lines are INFO records
    debug = serve_logging("DEBUG")
    assert debug.enable_access_log is True and debug.log_level == "DEBUG"
    assert serve_logging("DEBUG", access_log=False).enable_access_log is False


def test_every_deployment_gets_the_logging_config(tiny_llama):
    from deploy.builder import INGRESS_DRAIN_S, POOL_DRAIN_S, make_app

    app = make_app({"model": tiny_llama, "device": "cpu"})
    ingress = app._bound_deployment
    pools = [v._bound_deployment for v in ingress.init_kwargs.values() if hasattr(v, "_bound_deployment")]
    assert {p.name for p in pools} == {"prefill", "decode"}
    for deployment in [ingress, *pools]:
        config = deployment._deployment_config
        assert config.logging_config["enable_access_log"] is False, deployment.name
    assert ingress._deployment_config.graceful_shutdown_timeout_s == INGRESS_DRAIN_S
    assert all(p._deployment_config.graceful_shutdown_timeout_s == POOL_DRAIN_S > INGRESS_DRAIN_S for p in pools)
    with_log = make_app({"model": tiny_llama, "device": "cpu"}, access_log=True)
    assert with_log._bound_deployment._deployment_config.logging_config["enable_access_log"] is True
