"""A throwaway redis-server child process for tests and benchmarks.

Each instance owns one port and one temp dir; nothing is persisted (``--save "" --appendonly no``),
so ``restart()`` after ``kill()`` brings back an *empty* server on the same port, which is what a
crashed Redis without persistence looks like to its clients.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

REDIS_SERVER_CANDIDATES = ("redis-server", "/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    for candidate in REDIS_SERVER_CANDIDATES:
        path = shutil.which(candidate)
        if path:
            return path
    return None


# Below Linux's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): a port
# from here is never handed to someone else's `bind(0)` or outgoing connection between our probe
# and the server's own bind. A port from `bind(0)` was: a fresh Ray cluster's many processes took
# one while `pdserve up` was starting, and Serve's proxy then failed to bind it (a CI run).
_TEST_PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, from a range nothing else picks automatically."""
    for _ in range(200):
        port = random.choice(_TEST_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_TEST_PORTS.start}-{_TEST_PORTS.stop - 1} after 200 tries")


class RedisServer:
    """``redis-server`` on 127.0.0.1:<port>, started by ``start()``, SIGKILLed by ``kill()``."""

    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        binary = find_redis_server()
        if binary is None:
            raise FileNotFoundError("redis-server not found on PATH (install redis-server 7)")
        self.binary = binary
        self.password = password
        self.port = port or free_port()
        self.workdir = tempfile.mkdtemp(prefix="pdserve-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.workdir,
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {timeout_s}s")

    def _answers_ping(self) -> bool:
        request = b"PING\r\n"
        if self.password:
            pw = self.password.encode()
            request = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) + request
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(request)
                reply = b""
                while b"PONG" not in reply:
                    chunk = sock.recv(256)
                    if not chunk:
                        return False
                    reply += chunk
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; clients see their connections reset."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        """Kill if running, then start an empty server on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["RedisServer", "find_redis_server", "free_port"]

if __name__ == "__main__":  # manual check: python tests/redis_server.py
    with RedisServer() as server:
        print(server.url, os.getpid())
