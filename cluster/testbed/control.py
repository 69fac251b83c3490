"""`Testbed`: a testbed that is up, and what one does with it: commands on its hosts, its links'
counters and faults, host loss, and the Ray cluster and Serve application on it."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.testbed.network import _tbf_argv
from cluster.testbed.plan import _NS_IFACE, HTTP_PORT, Host, TestbedError
from cluster.testbed.processes import _alive, _pids_in_netns, _run, _signal
from cluster.testbed.startup import _record_pids, start_commands, yaml_commands
from cluster.testbed.state import TestbedState


@dataclass
class Testbed(TestbedState):
    # -- commands on hosts
    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.netns, *argv]

    def run(self, host: Host, command: str, timeout_s: float = 120.0, log: Path | None = None) -> tuple[int, str]:
        """Run a shell command on `host` with the testbed's environment; (exit code, output).
        Output goes to a log file, not a pipe: daemons the command starts keep no pipe open."""
        log = log or self.host_dir(host) / "commands.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(f"$ {command}\n".encode())
            f.flush()
            start = f.tell()
            proc = subprocess.run(
                self.exec_argv(host, ["bash", "-c", command]),
                env=self.env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout_s,
                cwd=str(self.home),
            )
        with open(log, "rb") as f:
            f.seek(start)
            output = f.read().decode(errors="replace")
        with open(log, "a") as f:
            f.write(f"[exit {proc.returncode}]\n")
        return proc.returncode, output

    # -- link counters and faults
    def link_bytes(self, host: Host) -> dict[str, int]:
        """rx/tx bytes counted on the host's own end of its link (inside its namespace)."""
        out = _run(
            self.exec_argv(
                host,
                [
                    "cat",
                    f"/sys/class/net/{_NS_IFACE}/statistics/rx_bytes",
                    f"/sys/class/net/{_NS_IFACE}/statistics/tx_bytes",
                ],
            )
        ).stdout.split()
        return {"rx": int(out[0]), "tx": int(out[1])}

    def set_link(self, host: Host, up: bool) -> None:
        """Cut (or restore) the host's link to the bridge: its veth in the root namespace."""
        _run(["ip", "link", "set", host.veth, "up" if up else "down"])

    def set_rate(self, host: Host, rate: str) -> None:
        """Change the host's link rate, both directions."""
        for argv in _tbf_argv("change", host.veth, rate), self.exec_argv(host, _tbf_argv("change", _NS_IFACE, rate)):
            _run(argv)

    # -- host loss
    def kill_host(self, host: Host) -> int:
        """The host dies: SIGKILL, at once, every process in its namespace (its Ray node, its
        replicas, its sshd), as a power cut would; the namespace and its link stay, so the host
        can be started again (`restart_host`). Returns how many processes were killed."""
        if host.role == "head":
            raise TestbedError("kill_host: the head carries the GCS and the Serve controller; kill a worker host")
        killed: set[int] = set()
        for _ in range(10):  # a process may be forking while we scan
            victims = [p for p in _pids_in_netns({host.netns_inode}) if p not in killed or _alive(p)]
            if not victims:
                break
            killed.update(_signal(victims, signal.SIGKILL))
            time.sleep(0.05)
        self.pids[host.name] = []
        self.save()
        return len(killed)

    def restart_host(self, host: Host, timeout_s: float = 180.0, say=print) -> None:
        """Start a worker host's node again after `kill_host` (its start commands, as at `up`)
        and wait until the head sees it alive."""
        if host.role == "head":
            raise TestbedError("restart_host: worker hosts only")
        # The head may still list the killed node as alive (until its health checks fail):
        # wait for a node at this address that was not there before.
        before = {n["node_id"] for n in self.alive_nodes() if n["node_ip"] == host.ip}
        deadline = time.monotonic() + timeout_s
        start_commands(self, host, yaml_commands("worker"), deadline, say)
        while not any(n["node_ip"] == host.ip and n["node_id"] not in before for n in self.alive_nodes()):
            if time.monotonic() > deadline:
                raise TestbedError(f"{host.name}: its Ray node did not rejoin within {timeout_s:g}s")
            time.sleep(1.0)
        _record_pids(self)
        say(f"{host.name} {host.ip}: Ray node started again")

    # -- the Ray cluster on it
    def alive_nodes(self) -> list[dict]:
        """The Ray nodes alive, from the head's dashboard (state API over HTTP: no driver here)."""
        from ray.util.state import list_nodes

        nodes = list_nodes(
            address=self.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False, timeout=10
        )
        return [n if isinstance(n, dict) else asdict(n) for n in nodes]

    def serve_config(self, model: str, **args: Any) -> dict:
        """A Serve config for this testbed: the head's Redis, each pool pinned to its hosts (one
        replica per host), the HTTP proxy on the head's address. `args` override PDServeArgs;
        attention is the sdpa backend unless they name one (the paged kernel would compile in
        every replica at start-up, for nothing the multi-host tests check)."""
        app_args = {
            "model": model,
            "device": "cpu",
            "attention_backend": "sdpa",
            "redis_url": self.redis_url,
            "transfer_timeout_s": 5.0,
            "prefill": {"replicas": max(1, len(self.role("prefill"))), "num_cpus": 0.5, "resources": {"prefill": 1}},
            "decode": {"replicas": max(1, len(self.role("decode"))), "num_cpus": 0.5, "resources": {"decode": 1}},
            **args,
        }
        return {
            "proxy_location": "HeadOnly",
            "http_options": {"host": self.head.ip, "port": HTTP_PORT},
            "applications": [
                {
                    "name": "pdserve",
                    "route_prefix": "/",
                    "import_path": "deploy.builder:build_app",
                    "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                    "args": app_args,
                }
            ],
        }

    def app_status(self, app: str = "pdserve") -> dict:
        """Serve's status of application `app` (the dashboard's REST API; {} when it has none)."""
        import httpx

        resp = httpx.get(f"{self.dashboard_url}/api/serve/applications/", timeout=30)
        resp.raise_for_status()
        return (resp.json().get("applications") or {}).get(app) or {}

    def deploy(
        self, config: dict, app: str = "pdserve", want: tuple[str, ...] = ("RUNNING",), timeout_s: float = 300.0
    ) -> dict:
        """`serve deploy` of `config` through the head's dashboard (the REST API the CLI uses: no
        driver in this process); waits until `app` is in a `want` state, and, for RUNNING, until
        the ingress's /health answers 200. Returns the app's status."""
        import httpx

        resp = httpx.put(f"{self.dashboard_url}/api/serve/applications/", json=config, timeout=60)
        if resp.status_code != 200:
            raise TestbedError(f"serve deploy refused ({resp.status_code}): {resp.text[-2000:]}")
        deadline = time.monotonic() + timeout_s
        status: dict = {}
        while True:
            try:
                status = self.app_status(app)
            except httpx.HTTPError:
                status = {}
            if status.get("status") in want:
                break
            if status.get("status") == "DEPLOY_FAILED":
                raise TestbedError(f"{app} failed to deploy: {status.get('message', '')[-3000:]}")
            if time.monotonic() > deadline:
                raise TestbedError(f"{app} not {'/'.join(want)} after {timeout_s:g}s: {status}")
            time.sleep(2.0)
        if status.get("status") == "RUNNING":
            route = next(
                (
                    a.get("route_prefix") or "/"
                    for a in config.get("applications", [])
                    if a.get("name", "default") == app
                ),
                "/",
            )
            while True:
                try:
                    if httpx.get(f"{self.http_url}{route.rstrip('/')}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TestbedError(f"{self.http_url}{route.rstrip('/')}/health: no 200 within {timeout_s:g}s")
                time.sleep(1.0)
        return status
