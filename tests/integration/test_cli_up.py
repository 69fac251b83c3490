"""`pdserve up` as an operator runs it: a subprocess in its own session (as a terminal job),
started on a tiny model and a free port, stopped with Ctrl-C sent to its whole process group.

What a normal run must show: one line per start-up phase, the banner once requests can be
served, `/health` answering (503 "starting" or 200, never held once the ingress runs), and on
Ctrl-C an orderly stop that exits 0 with no error-looking line (the managed redis-server used to
die first of the group's SIGINT: "Redis index … lost", "could not leave the prefix index"), no
Serve access log, and nothing left running."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from cluster.local import LOG_MONITOR_ENV, RAY_IDLE_CONFIG, SERVE_PERIODS_ENV
from tests.integration.conftest import wait_idle
from tests.integration.test_faults import expected_text, requests_status, wait_ended
from tests.integration.test_serve_app import scrape
from tests.redis_server import RedisServer, find_redis_server, free_port

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]
REPO_ROOT = Path(__file__).resolve().parents[2]
BAD = ("ERROR", "Traceback", "lost", "could not leave", "graceful_shutdown failed", "sample failed")
ACCESS_LOG = re.compile(r"\bCALL\b|\b(GET|POST) /\S* \d{3} ")  # Serve's access-log lines


class Up:
    """One `pdserve up` run; its stdout and stderr together, line by line."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self._new = threading.Condition()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.ops.cli", "up", *args],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a shell job: killpg reaches all of it
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()

    def wait_for(self, text: str, timeout_s: float, also: str = "") -> str:
        """The first line holding ``text`` (and ``also``), waiting for it up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                for line in self.lines:
                    if text in line and also in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no {text!r} {also!r} line (exit {self.proc.poll()}):\n" + self.output)
                self._new.wait(min(left, 0.5))

    def ctrl_c(self, timeout_s: float = 120) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        return self.proc.wait(timeout=timeout_s)

    def _ps(self, columns: str) -> list[str]:
        """``ps``'s ``columns`` (untruncated) of every process in the session, one line each."""
        out = subprocess.run(["ps", "-ww", "-o", columns, "--sid", str(self.proc.pid)], capture_output=True, text=True)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def session_processes(self) -> list[str]:
        return self._ps("pid=,comm=")

    def session_commands(self) -> list[str]:
        """The full command line of every process in the session."""
        return self._ps("args=")

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _check_clean(up: Up) -> None:
    bad = [line for line in up.lines if any(word in line for word in BAD)]
    assert not bad, "error-looking lines on a normal run:\n" + "\n".join(bad)
    access = [line for line in up.lines if ACCESS_LOG.search(line)]
    assert not access, "access-log lines on the console:\n" + "\n".join(access[:10])
    assert _until(lambda: not up.session_processes(), 30), f"left running: {up.session_processes()}"


def _serve_processes(up: Up, controller: bool = False) -> Iterator[tuple[str, int]]:
    """(deployment, pid) of each Serve replica process in the session, and with ``controller``
    ("ServeController", pid) of Serve's controller too."""
    for line in up.session_processes():
        pid = int(line.split()[0])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        if "ServeReplica" in cmdline:
            yield cmdline.split("\0")[0].rsplit(":", 1)[-1].strip(), pid
        elif controller and "ServeController" in cmdline:
            yield "ServeController", pid


def _environ(pid: int) -> dict[str, str]:
    """The environment a process started with (FileNotFoundError once it is gone)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _serve_environments(up: Up) -> dict[str, dict[str, str]]:
    """The environment of Serve's controller and of each replica process in the session, by
    deployment ("ServeController" for the controller)."""
    found: dict[str, dict[str, str]] = {}
    for name, pid in _serve_processes(up, controller=True):
        try:
            found[name] = _environ(pid)
        except FileNotFoundError:
            continue
    return found


def _ray_daemons(up: Up) -> tuple[dict, dict[str, str]]:
    """The system config the session's GCS was started with (its ``--config_list``, base64 JSON)
    and the environment of Ray's log monitor."""
    config: dict = {}
    log_monitor_env: dict[str, str] = {}
    for line in up.session_processes():
        pid = int(line.split()[0])
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if args[0].endswith("/gcs_server"):
                encoded = next(a.split("=", 1)[1] for a in args if a.startswith("--config_list="))
                config = json.loads(base64.b64decode(encoded))
            elif any(a.endswith("log_monitor.py") for a in args):
                log_monitor_env = _environ(pid)
        except FileNotFoundError:
            continue
    return config, log_monitor_env


def _replica_threads_niceness(up: Up) -> dict[str, set[int]]:
    """The niceness of every thread of each Serve replica process in the session, by deployment."""
    found: dict[str, set[int]] = {}
    for name, pid in _serve_processes(up):
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:  # field 19 of stat (after the command's closing parenthesis: the 17th) is nice
                found.setdefault(name, set()).add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
            except FileNotFoundError:
                continue
    return found


def _serve_one(base: str) -> dict:
    prompt = list(range(3, 67))  # four full KV blocks: published to the prefix index
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_up_narrates_serves_and_stops_cleanly_on_ctrl_c(tiny_llama):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = Up("--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port))
    try:
        up.wait_for("model resolved", 60)
        ray_line = up.wait_for("Ray started", 120)
        assert "Ray dashboard off" in ray_line  # no --ray-dashboard, no pd autoscaling
        redis_line = up.wait_for("Redis started", 60)
        redis_pid = int(re.search(r"\(pid (\d+)\)", redis_line).group(1))
        assert os.getpgid(redis_pid) != up.proc.pid  # not in the group a Ctrl-C reaches
        up.wait_for("ingress: 1/1 replica ready", 240)

        # Once the ingress runs, /health answers at once: 503 "starting" until the pools do, then 200.
        answers: list[int] = []
        while not any("pdserve is up" in line for line in up.lines):
            resp = httpx.get(f"{base}/health", timeout=5)  # a hang fails here
            answers.append(resp.status_code)
            assert resp.status_code in (200, 503), resp.text
            if resp.status_code == 503:
                assert resp.json()["status"] == "starting"
            assert up.proc.poll() is None, up.output
            time.sleep(0.2)
        banner = up.wait_for("pdserve is up", 5)
        assert f"http://127.0.0.1:{port}/v1" in banner
        for phase in ("prefill: 1/1 replica ready", "decode: 1/1 replica ready"):
            up.wait_for(phase, 5)  # each pool said it is ready, before the banner
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 200 and health.json() == {"status": "ok"}  # the banner means serving

        assert _serve_one(base)["choices"][0]["finish_reason"] in ("length", "stop")

        # The replicas' own start-up lines reach the console (through Serve's replica logger,
        # deploy/replica_logging.py): each pool's threads and KV blocks, the engine's attention
        # kernel, the ingress.
        for role in ("prefill", "decode"):
            up.wait_for(f"{role} replica", 30, also="engine runs torch with")
            up.wait_for(f"{role} replica", 30, also="KV blocks on cpu")
        up.wait_for("attention ready in", 30)
        up.wait_for("ingress ready: model tiny", 30)
        coloured = [line for line in up.lines if "\x1b[" in line]
        assert not coloured, "terminal colour codes in piped output:\n" + "\n".join(coloured[:5])

        # Without Ray's dashboard (none of its module processes: NodeHead, StateHead, ServeHead, ...),
        # its metrics agent still exports pdserve's metrics where the start-up line says.
        commands = up.session_commands()
        assert not [c for c in commands if c.startswith("ray-dashboard-")], commands
        metrics = re.search(r"metrics (http://\S+/metrics)", ray_line)
        assert metrics is not None, ray_line
        assert _until(lambda: _requests_exported(metrics.group(1)) >= 1, 60)

        # The engines do not yield the CPU to Ray's daemons: a Ray that pdserve up started runs its
        # workers, the replicas and every thread of theirs, at niceness 0 (Ray's default is 15).
        replicas = _replica_threads_niceness(up)
        assert {"prefill", "decode", "ingress"} <= set(replicas), up.session_processes()
        assert all(values == {0} for values in replicas.values()), replicas
        # ... and Serve's controller and replicas run at pdserve's periods (cluster/local.py)
        environments = _serve_environments(up)
        assert {"ServeController", "prefill", "decode", "ingress"} <= set(environments), up.session_processes()
        for name, environment in environments.items():
            assert {k: environment.get(k) for k in SERVE_PERIODS_ENV} == SERVE_PERIODS_ENV, name
        # ... and Ray's own daemons at pdserve's periods: the GCS hands the system config to every
        # process of the cluster; the log monitor reads its threshold from its environment.
        config, log_monitor_env = _ray_daemons(up)
        assert {k: config.get(k) for k in RAY_IDLE_CONFIG} == RAY_IDLE_CONFIG, config
        assert config.get("worker_niceness") == 0, config
        assert {k: log_monitor_env.get(k) for k in LOG_MONITOR_ENV} == LOG_MONITOR_ENV

        assert up.ctrl_c() == 0, up.output
    finally:
        up.close()
    up.wait_for("ingress drained", 5)
    up.wait_for("Redis stopped", 5)
    _check_clean(up)
    assert not _alive(redis_pid)


def _requests_exported(url: str) -> float:
    """``pdserve_requests_total`` as Prometheus would scrape it from ``url``; 0 while nothing answers."""
    try:
        return scrape(url).get("pdserve_requests_total", 0.0)
    except httpx.HTTPError:
        return 0.0


def test_up_leaves_the_prefix_index_before_it_stops(tiny_llama):
    """With a Redis of our own (it outlives pdserve): after Ctrl-C every worker has left the
    index, i.e. the replicas deregistered while Redis was still reachable."""
    port = free_port()
    with RedisServer() as server:
        up = Up("--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port), "--redis-url", server.url)
        try:
            up.wait_for("Redis connected", 120)
            up.wait_for("pdserve is up", 300)
            _serve_one(f"http://127.0.0.1:{port}")
            with redis.Redis.from_url(server.url) as client:
                assert _until(lambda: len(client.keys("pd:*:worker:*")) == 2, 30)  # both workers joined
                assert _until(lambda: client.keys("pd:*:blk:*"), 30)  # and published the request's blocks
            assert up.ctrl_c() == 0, up.output
        finally:
            up.close()
        with redis.Redis.from_url(server.url) as client:
            assert client.keys("pd:*:worker:*") == []
            assert client.keys("pd:*:wblocks:*") == [] and client.keys("pd:*:blk:*") == []
            assert all(client.hlen(key) == 0 for key in client.keys("pd:*:workers"))
    _check_clean(up)


def test_up_with_haproxy_serves_exactly_through_haproxy_and_stops_cleanly(tiny_llama):
    """`pdserve up --haproxy`: HAProxy (not Serve's Python proxy) holds the port, and what comes
    through it is what the engine makes: greedy text exact against transformers, plain and as SSE;
    a bad parameter is a 400 naming it; a client that leaves mid-stream aborts its request and
    frees its blocks; Ctrl-C stops everything, HAProxy included."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = Up(
        "--model", tiny_llama, "--served-model-name", "tiny", "--port", str(port),
        "--mode", "colocated", "--colocated", "1", "--haproxy",
    )  # fmt: skip
    try:
        up.wait_for("HTTP through HAProxy", 120)
        up.wait_for("pdserve is up", 300)
        holders = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert '"haproxy"' in holders, holders  # HAProxy listens on the port, not Serve's proxy
        assert httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["http_front_end"] == "haproxy"
        environments = _serve_environments(up)
        assert environments["ingress"].get("RAY_SERVE_ENABLE_HA_PROXY") == "1", environments["ingress"]

        prompt = list(range(3, 40))
        want = expected_text(tiny_llama, prompt, 8)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        plain = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == want
        events: list[str] = []
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want

        bad = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": -3}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text

        before = requests_status(base)
        long = {**body, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as resp:
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: ")
                if got == 4:
                    break  # leave mid-stream: HAProxy closes its side to the ingress replica
        after = wait_ended(base, before, 1)
        assert after["aborted"] == before["aborted"] + 1, (before, after)  # a disconnect is an abort,
        assert after["failed"] == before["failed"], (before, after)  # not a failure
        status = wait_idle(base)
        assert all(r["num_running"] == 0 for pool in status["pools"].values() for r in pool)

        assert up.ctrl_c() == 0, up.output
    finally:
        up.close()
    up.wait_for("Ray stopped", 5)
    _check_clean(up)  # nothing left in the session, HAProxy included
