"""A cluster on one machine: hosts as network namespaces on a bridge (`pdserve testbed up|down|status`).

Each host is a network namespace with one veth link to a Linux bridge in the root namespace, its
own address on a private /24 (default 10.231.0.0/24: the bridge .1, the head .10, prefill hosts
.11-.19, decode hosts .21-.29), `lo` up, and a token-bucket rate on its link (`tc qdisc tbf`,
both directions; 1gbit by default). Nothing routes out of that /24: the namespaces have no
default route and the root namespace does not forward.

What runs on each host is what a real node runs: `cluster/testbed.yaml`'s start commands (the
head: Ray head with its node IP, Redis for the prefix index bound to the head's address on 6380,
Serve's HTTP proxy on the head's address; a worker: `ray start --address <head>:6379
--node-ip-address <own> --resources '{"prefill": 1}'` or decode), run inside the host's
namespace (`ip netns exec`). With `--no-ray` only the hosts (and an sshd on each) come up, and
`ray up cluster/testbed.yaml` runs the same commands over ssh.

Every host shares this machine's filesystem: a model directory under /tmp serves every host.
Commands run with HOME=<state dir>/home (never root's home), whose .bashrc puts this venv on PATH
in front of a `ray` wrapper whose `ray stop` stops only the calling host's Ray (the real `ray stop`
stops every Ray process on the machine).

State. Everything made is recorded in `<state dir>/state.json` before or as it is made
(namespaces with their nsfs inode, links, pids), so `down` removes every namespace, link and
process it made, also after a failed or killed `up`; `up` first runs `down` for its own prefix
and also removes leftovers of that prefix found by name (`ip netns list`, `ip link`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PREFIX = "pdtb"
DEFAULT_SUBNET = "10.231.0"  # a /24: <subnet>.1 the bridge, .10 the head, .11-.19 prefill, .21-.29 decode
DEFAULT_STATE_DIR = "/tmp/pdtb"
DEFAULT_RATE = "1gbit"
HEAD_OCTET, PREFILL_OCTET, DECODE_OCTET, MAX_PER_ROLE = 10, 11, 21, 9
GCS_PORT, REDIS_PORT, HTTP_PORT, DASHBOARD_PORT = 6379, 6380, 8000, 8265
TESTBED_YAML = Path(__file__).with_name("testbed.yaml")
SSHD = "/usr/sbin/sshd"
_NS_IFACE = "eth0"  # the host's end of its link, inside its namespace
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TestbedError(RuntimeError):
    pass


# -- plan ------------------------------------------------------------------------------------


@dataclass
class Host:
    name: str  # also the namespace's name
    role: str  # head, prefill, decode
    ip: str
    veth: str  # the root namespace's end of the host's link (a bridge port)
    netns_inode: int = 0  # the namespace's nsfs inode once made: finds its processes after a crash

    @property
    def netns(self) -> str:
        return self.name


def plan_hosts(prefix: str, subnet: str, num_prefill: int, num_decode: int) -> list[Host]:
    if not 1 <= len(prefix) <= 8 or not prefix.replace("-", "").isalnum():
        raise TestbedError(f"prefix {prefix!r}: 1-8 letters or digits (link names have 15 characters)")
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        if not 0 <= count <= MAX_PER_ROLE:
            raise TestbedError(f"{count} {role} hosts: 0 to {MAX_PER_ROLE}")
    hosts = [Host(f"{prefix}-head", "head", f"{subnet}.{HEAD_OCTET}", f"{prefix}-head")]
    hosts += [
        Host(f"{prefix}-p{i}", "prefill", f"{subnet}.{PREFILL_OCTET + i}", f"{prefix}-p{i}") for i in range(num_prefill)
    ]
    hosts += [
        Host(f"{prefix}-d{i}", "decode", f"{subnet}.{DECODE_OCTET + i}", f"{prefix}-d{i}") for i in range(num_decode)
    ]
    return hosts


@dataclass
class Testbed:
    prefix: str
    subnet: str
    state_dir: str
    rate: str
    venv: str
    hosts: list[Host]
    bridge: str
    sshd: bool = False
    ray: bool = True
    pids: dict[str, list[int]] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # what up made, in order (for the record)
    phase: str = "creating"

    # -- where things are
    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def head(self) -> Host:
        return next(h for h in self.hosts if h.role == "head")

    def role(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.role == role]

    def host(self, name_or_ip: str) -> Host:
        for h in self.hosts:
            if name_or_ip in (h.name, h.ip):
                return h
        raise KeyError(name_or_ip)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.head.ip}:{REDIS_PORT}/0"

    @property
    def http_url(self) -> str:
        return f"http://{self.head.ip}:{HTTP_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    @property
    def home(self) -> Path:
        return Path(self.state_dir) / "home"

    @property
    def bin_dir(self) -> Path:
        return Path(self.state_dir) / "bin"

    @property
    def ssh_dir(self) -> Path:
        return Path(self.state_dir) / "ssh"

    @property
    def ssh_key(self) -> Path:
        return self.ssh_dir / "id_ed25519"

    def host_dir(self, host: Host) -> Path:
        return Path(self.state_dir) / "hosts" / host.name

    def ray_temp_dir(self, host: Host) -> Path:
        return Path(self.state_dir) / "ray" / host.ip  # as testbed.yaml's --temp-dir

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / "state.json"

    def env(self) -> dict[str, str]:
        """The environment of every command run on a host (the same as an ssh session's)."""
        return {
            "HOME": str(self.home),
            "PATH": f"{self.bin_dir}:{self.venv}/bin:{_SYS_PATH}",
            "PDTB_DIR": self.state_dir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "RAY_HEAD_IP": self.head.ip,
            "RAY_ADDRESS": self.gcs_address,
            "TOKENIZERS_PARALLELISM": "false",
        }

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

    # -- state file
    def save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, state_dir: str) -> Testbed | None:
        path = Path(state_dir) / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)


# -- shell helpers ---------------------------------------------------------------------------


def _run(argv: list[str], check: bool = True, timeout_s: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    if check and proc.returncode != 0:
        output = proc.stderr.strip() or proc.stdout.strip()
        raise TestbedError(f"{shlex.join(argv)} failed ({proc.returncode}): {output}")
    return proc


def _tbf_argv(verb: str, dev: str, rate: str) -> list[str]:
    # burst: at least one 10 ms tick of the rate (and a jumbo GSO segment); latency caps the queue.
    bits = _rate_bits(rate)
    burst = max(64 * 1024, bits // 8 // 100)
    return ["tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(rate[: -len(unit)]) * scale)
    raise TestbedError(f"rate {rate!r}: use a tc rate such as 1gbit, 200mbit, 500kbit")


def _netns_inode(name: str) -> int:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return 0


def _pid_netns_inode(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pids_in_netns(inodes: set[int]) -> list[int]:
    inodes.discard(0)
    if not inodes:
        return []
    me = os.getpid()
    return [pid for pid in _all_pids() if pid != me and _pid_netns_inode(pid) in inodes]


def _signal(pids: list[int], sig: int) -> list[int]:
    """Send `sig` to each of `pids`; returns those that were still there."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent.append(pid)
        except ProcessLookupError:
            pass
    return sent


def _kill_pids(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL what is left after `grace_s`; returns the pids signalled."""
    signalled = _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in signalled):
        time.sleep(0.1)
    _signal([pid for pid in signalled if _alive(pid)], signal.SIGKILL)
    return signalled


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(": ", 2)
        if len(parts) >= 2:
            names.append(parts[1].split("@", 1)[0])
    return names


def check_subnet(subnet: str) -> None:
    """The testbed's /24 must be private and unused here: no route of this machine may reach into
    it (its traffic stays on the bridge, between the testbed's own namespaces)."""
    import ipaddress

    try:
        net = ipaddress.ip_network(f"{subnet}.0/24")
    except ValueError as exc:
        raise TestbedError(f"subnet {subnet!r}: give the first three octets of an IPv4 /24 ({exc})") from exc
    if not net.is_private or net.is_loopback or net.is_link_local:
        raise TestbedError(f"subnet {net} is not a private range: use e.g. 10.231.0")
    for line in _run(["ip", "-o", "-4", "route", "show"], check=False).stdout.splitlines():
        dest = line.split()[0]
        if dest == "default":
            continue
        try:
            other = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        if other.overlaps(net):
            raise TestbedError(f"subnet {net} overlaps a route of this machine ({line.strip()}): pick another")


def check_environment() -> str | None:
    """Why namespace hosts cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (the head runs the prefix index)"
    return None


# -- up / down -------------------------------------------------------------------------------


def up(
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    num_prefill: int = 1,
    num_decode: int = 1,
    rate: str = DEFAULT_RATE,
    state_dir: str = DEFAULT_STATE_DIR,
    start_ray: bool = True,
    sshd: bool | None = None,
    venv: str | None = None,
    timeout_s: float = 180.0,
    say=print,
) -> Testbed:
    """Make the hosts and start what runs on them; on any failure everything made is removed."""
    problem = check_environment()
    if problem:
        raise TestbedError(problem)
    _rate_bits(rate)
    hosts = plan_hosts(prefix, subnet, num_prefill, num_decode)
    removed = down(prefix, state_dir, say=lambda *_: None)
    if removed:
        say(f"removed leftovers of an earlier testbed {prefix!r}: {', '.join(removed)}")
    check_subnet(subnet)
    if sshd is None:
        sshd = not start_ray and Path(SSHD).exists()
    if sshd and not Path(SSHD).exists():
        raise TestbedError(f"{SSHD} is missing: apt-get install -y openssh-server (or pass --no-sshd)")
    tb = Testbed(
        prefix=prefix,
        subnet=subnet,
        state_dir=str(Path(state_dir).resolve()),
        rate=rate,
        venv=venv or sys.prefix,
        hosts=hosts,
        bridge=f"{prefix}-br",
        sshd=sshd,
        ray=start_ray,
    )
    try:
        _write_files(tb)
        tb.save()
        _make_network(tb, say)
        if sshd:
            _start_sshd(tb, say)
        if start_ray:
            start_cluster(tb, say, timeout_s=timeout_s)
        tb.phase = "up"
        tb.save()
    except BaseException:
        say(
            f"testbed {prefix!r} failed to come up; removing what was made "
            f"(logs were in {tb.state_dir}/hosts/*/start.log)"
        )
        _print_start_logs(tb, say)
        down(prefix, tb.state_dir, say=say)
        raise
    return tb


def _write_files(tb: Testbed) -> None:
    for d in (tb.home, tb.bin_dir, tb.ssh_dir, *(tb.host_dir(h) for h in tb.hosts)):
        d.mkdir(parents=True, exist_ok=True)
    bashrc = (
        f"export PDTB_DIR={shlex.quote(tb.state_dir)}\n"
        f"export PATH={shlex.quote(str(tb.bin_dir))}:{shlex.quote(tb.venv)}/bin:$PATH\n"
        "export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false LANG=C.UTF-8\n"
        # `ray status`, `serve status`, drivers: this cluster, not another Ray on the machine
        f"export RAY_ADDRESS={tb.gcs_address}\n"
    )
    (tb.home / ".bashrc").write_text(bashrc)
    (tb.home / ".bash_profile").write_text(". ~/.bashrc\n")
    (tb.home / ".profile").write_text(". ~/.bashrc\n")
    for stale in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem"):  # a testbed start has no autoscaler
        (tb.home / stale).unlink(missing_ok=True)
    python = Path(tb.venv) / "bin" / "python"
    wrapper = tb.bin_dir / "ray"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# `ray` on a testbed host. The real `ray stop` stops every Ray process of the machine (all\n"
        "# testbed hosts and any other Ray here): on a testbed host it stops this host's Ray only.\n"
        f'if [ "$1" = stop ]; then exec {shlex.quote(str(python))} -m cluster.testbed stop-host '
        f"--state-dir {shlex.quote(tb.state_dir)}; fi\n"
        f'exec {shlex.quote(tb.venv)}/bin/ray "$@"\n'
    )
    wrapper.chmod(0o755)
    ssh = tb.bin_dir / "ssh"
    ssh.write_text(
        "#!/bin/bash\n"
        "# `ssh` on testbed hosts. ssh expands `~` in `-i ~/ray_bootstrap_key.pem` (the head's autoscaler\n"
        "# reaching the workers) from the passwd entry, root's home, while testbed sessions keep their\n"
        "# files in $HOME, the testbed's home: point such arguments there.\n"
        "args=()\n"
        'for a in "$@"; do [[ $a == "~/"* ]] && a="$HOME/${a#\\~/}"; args+=("$a"); done\n'
        'exec /usr/bin/ssh "${args[@]}"\n'
    )
    ssh.chmod(0o755)
    session = tb.bin_dir / "session"
    session.write_text(
        "#!/bin/sh\n"
        "# sshd's ForceCommand on testbed hosts: every session gets the testbed's HOME (never root's).\n"
        f"export HOME={shlex.quote(str(tb.home))}\n"
        'cd "$HOME"\n'
        'if [ -z "$SSH_ORIGINAL_COMMAND" ]; then exec bash --login; fi\n'
        'exec bash -c "$SSH_ORIGINAL_COMMAND"\n'
    )
    session.chmod(0o755)


def _make_network(tb: Testbed, say) -> None:
    tb.made.append(f"link {tb.bridge}")
    tb.save()
    _run(["ip", "link", "add", tb.bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{tb.bridge_ip}/24", "dev", tb.bridge])
    _no_ipv6(tb.bridge)  # IPv4 only: no link-local chatter on the links' counters
    _run(["ip", "link", "set", tb.bridge, "up"])
    for host in tb.hosts:
        tb.made += [f"netns {host.netns}", f"link {host.veth}"]
        tb.save()
        _run(["ip", "netns", "add", host.netns])
        host.netns_inode = _netns_inode(host.netns)
        tb.save()
        peer = f"{host.veth}-x"
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", host.netns])
        _run(["ip", "link", "set", host.veth, "master", tb.bridge])
        _no_ipv6(host.veth)
        _run(["ip", "link", "set", host.veth, "up"])

        def ns(*argv: str, host: Host = host) -> None:  # this iteration's host, bound
            _run(tb.exec_argv(host, list(argv)))

        ns(
            "sh",
            "-c",
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
        )
        ns("ip", "link", "set", "lo", "up")
        ns("ip", "link", "set", peer, "name", _NS_IFACE)
        ns("ip", "addr", "add", f"{host.ip}/24", "dev", _NS_IFACE)
        ns("ip", "link", "set", _NS_IFACE, "up")
        _run(_tbf_argv("add", host.veth, tb.rate))  # towards the host
        ns(*_tbf_argv("add", _NS_IFACE, tb.rate))  # from the host
    say(
        "hosts: "
        + ", ".join(f"{h.name} {h.ip} ({h.role})" for h in tb.hosts)
        + f"; bridge {tb.bridge} {tb.bridge_ip}/24; links {tb.rate}"
    )


def _no_ipv6(dev: str) -> None:
    try:
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")
    except OSError:
        pass  # no IPv6 here at all


def _start_sshd(tb: Testbed, say) -> None:
    if not tb.ssh_key.exists():
        _run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"pdserve-testbed-{tb.prefix}", "-f", str(tb.ssh_key)]
        )
    host_key = tb.ssh_dir / "host_ed25519"
    if not host_key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
    (tb.ssh_dir / "authorized_keys").write_text(tb.ssh_key.with_suffix(".pub").read_text())
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    for host in tb.hosts:
        d = tb.host_dir(host)
        config = d / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {host.ip}",
                    "Port 22",
                    f"HostKey {host_key}",
                    f"PidFile {d / 'sshd.pid'}",
                    f"AuthorizedKeysFile {tb.ssh_dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    "AcceptEnv none",
                    f"ForceCommand {tb.bin_dir / 'session'}",
                    "MaxStartups 64:30:128",
                    "MaxSessions 64",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        _run(tb.exec_argv(host, [SSHD, "-f", str(config), "-E", str(d / "sshd.log")]))
        pid = _wait_pidfile(d / "sshd.pid")
        tb.pids.setdefault(host.name, []).append(pid)
        tb.made.append(f"sshd {host.name} pid {pid}")
        tb.save()
    say(f"sshd on every host (port 22, user root, key {tb.ssh_key})")


def _wait_pidfile(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.05)
    raise TestbedError(f"{path} did not appear within {timeout_s:g}s")


def yaml_commands(kind: str) -> list[str]:
    """`head_start_ray_commands` or `worker_start_ray_commands` of cluster/testbed.yaml."""
    import yaml

    with open(TESTBED_YAML) as f:
        return list(yaml.safe_load(f)[f"{kind}_start_ray_commands"])


def start_commands(tb: Testbed, host: Host, commands: list[str], deadline: float, say=print, attempts: int = 3) -> None:
    """Run a host's start commands (testbed.yaml's) inside its namespace, before `deadline`.

    `ray start` gives a node 30 s (hard-coded) to register with the GCS; on a loaded machine
    that can pass, so the host's commands run again (they begin with this host's `ray stop`)."""
    log = tb.host_dir(host) / "start.log"
    for attempt in range(1, attempts + 1):
        for command in commands:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TestbedError(f"{host.name}: start commands ran past their deadline")
            rc, output = tb.run(host, command, timeout_s=left, log=log)
            if rc != 0:
                break
        else:
            return
        error = f"{host.name}: `{command[:120]}` failed ({rc}): {output.strip()[-800:]}"
        if attempt == attempts:
            raise TestbedError(error)
        say(f"{error.splitlines()[0][:200]}...; starting {host.name} again ({attempt + 1}/{attempts})")


def start_cluster(tb: Testbed, say=print, timeout_s: float = 180.0) -> None:
    """What `ray up cluster/testbed.yaml` runs, run inside each host's namespace instead of over ssh:
    the head's start commands, then every worker's, then wait until every node is alive."""
    deadline = time.monotonic() + timeout_s

    def run_all(host: Host, commands: list[str]) -> None:
        start_commands(tb, host, commands, deadline, say)

    run_all(tb.head, yaml_commands("head"))
    say(
        f"head {tb.head.ip}: Ray (GCS :{GCS_PORT}, dashboard {tb.dashboard_url}), Redis {tb.redis_url}, "
        f"Serve HTTP {tb.http_url}"
    )
    errors: list[BaseException] = []

    def worker(host: Host) -> None:
        try:
            run_all(host, yaml_commands("worker"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(h,)) for h in tb.hosts if h.role != "head"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    _record_pids(tb)
    want = len(tb.hosts)
    while True:
        try:
            alive = tb.alive_nodes()
        except Exception:  # noqa: BLE001 - the dashboard may still be starting
            alive = []
        if len(alive) >= want:
            break
        if time.monotonic() > deadline:
            raise TestbedError(f"{len(alive)} of {want} Ray nodes alive after {timeout_s:g}s")
        time.sleep(1.0)
    _record_pids(tb)
    say(f"Ray cluster up: {want} nodes alive (" + ", ".join(f"{h.ip} {h.role}" for h in tb.hosts) + ")")


def _record_pids(tb: Testbed) -> None:
    for host in tb.hosts:
        pids = set(tb.pids.get(host.name, [])) | set(_pids_in_netns({host.netns_inode}))
        tb.pids[host.name] = sorted(pids)
    tb.save()


def down(prefix: str = DEFAULT_PREFIX, state_dir: str = DEFAULT_STATE_DIR, say=print) -> list[str]:
    """Remove every namespace, link and process of testbed `prefix` (from its state file, and
    whatever carries its prefix by name); returns what was removed. Safe to run twice."""
    removed: list[str] = []
    tb = Testbed.load(state_dir)
    if tb is not None and tb.prefix != prefix:
        raise TestbedError(f"{state_dir} holds testbed {tb.prefix!r}, not {prefix!r}: pass --state-dir")
    # Our namespaces: those of the state file and those carrying our prefix, as they exist now
    # (an inode is only trusted while its name still exists: freed inodes are reused).
    existing = _netns_names()
    names = sorted(
        {n for n in existing if n.startswith(f"{prefix}-")}
        | ({h.netns for h in tb.hosts if h.netns in existing} if tb is not None else set())
    )
    inodes = {_netns_inode(n) for n in names}
    # Processes: everything inside those namespaces (Ray, Redis, sshd, replicas); all of them are
    # the testbed's, since only the testbed starts anything in them.
    # Rounds: a process starting another (`ray start` mid-way) may add one after a scan.
    killed: set[int] = set()
    for _ in range(10):
        victims = _pids_in_netns(set(inodes))
        if not victims:
            break
        _kill_pids(sorted(victims))
        killed |= set(victims)
    if killed:
        removed.append(f"{len(killed)} processes")
    for name in names:
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(f"netns {name}")
    for link in _link_names():
        if link.startswith(f"{prefix}-"):
            if _run(["ip", "link", "del", link], check=False).returncode == 0:
                removed.append(f"link {link}")
    if tb is not None or Path(state_dir, "state.json").exists():
        root = Path(state_dir)
        for sub in ("hosts", "ray", "home", "bin", "ssh"):
            shutil.rmtree(root / sub, ignore_errors=True)
        (root / "state.json").unlink(missing_ok=True)
        (root / "state.tmp").unlink(missing_ok=True)
        try:
            root.rmdir()
        except OSError:
            pass  # something of the user's is there: left alone
        if Path(state_dir).resolve() == Path(DEFAULT_STATE_DIR).resolve():  # testbed.yaml's testbed
            removed += _remove_ray_up_caches()
    if removed:
        say(f"testbed {prefix!r} removed: {', '.join(removed)}")
    return removed


def _remove_ray_up_caches() -> list[str]:
    """`ray up/exec/down cluster/testbed.yaml` cache the bootstrapped config in /tmp/ray-config-*."""
    import yaml

    with open(TESTBED_YAML) as f:
        name = yaml.safe_load(f)["cluster_name"]
    removed = []
    for path in Path("/tmp").glob("ray-config-*"):
        try:
            cached = json.loads(path.read_text())
            if cached.get("config", cached).get("cluster_name") == name:
                path.unlink()
                removed.append(f"ray up cache {path}")
        except (OSError, ValueError, AttributeError):
            continue
    return removed


def status(prefix: str = DEFAULT_PREFIX, state_dir: str = DEFAULT_STATE_DIR) -> dict:
    tb = Testbed.load(state_dir)
    names = _netns_names()
    result: dict[str, Any] = {
        "prefix": prefix,
        "state_file": str(Path(state_dir) / "state.json"),
        "recorded": tb is not None,
        "netns": [n for n in names if n.startswith(f"{prefix}-")],
        "links": [n for n in _link_names() if n.startswith(f"{prefix}-")],
    }
    if tb is None:
        return result
    result.update(
        phase=tb.phase,
        rate=tb.rate,
        redis_url=tb.redis_url,
        http_url=tb.http_url,
        dashboard_url=tb.dashboard_url,
        gcs_address=tb.gcs_address,
        hosts=[],
    )
    for h in tb.hosts:
        pids = _pids_in_netns({h.netns_inode}) if h.netns in names else []
        entry = {
            "name": h.name,
            "role": h.role,
            "ip": h.ip,
            "veth": h.veth,
            "processes": len(pids),
            "link_up": h.netns in names and _link_is_up(h.veth),
        }
        result["hosts"].append(entry)
    if tb.head.netns in names and _port_open(tb.head, DASHBOARD_PORT):
        try:
            result["ray_nodes_alive"] = len(tb.alive_nodes())
        except Exception as exc:  # noqa: BLE001 - status reports, never raises
            result["ray_nodes_alive"] = f"unknown: {exc}"
    else:
        result["ray_nodes_alive"] = 0 if tb.head.netns in names else "no head"
    return result


def _port_open(host: Host, port: int, timeout_s: float = 1.0) -> bool:
    import socket

    try:
        with socket.create_connection((host.ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _link_is_up(link: str) -> bool:
    flags = _run(["ip", "-o", "link", "show", link], check=False).stdout.split("<", 1)[-1].split(">", 1)[0]
    return "UP" in flags.split(",")


def _print_start_logs(tb: Testbed, say) -> None:
    for host in tb.hosts:
        log = tb.host_dir(host) / "start.log"
        if log.exists():
            say(f"--- {host.name} start.log (tail) ---\n" + "\n".join(log.read_text().splitlines()[-25:]))


# -- `ray stop` of one host ------------------------------------------------------------------


def stop_host(state_dir: str | None = None, grace_s: float = 10.0) -> int:
    """Stop the Ray processes of the testbed host this runs on (what `ray stop` does for one node).

    Acts only when this process sits in one of the namespaces the testbed's state file records
    (`state_dir`, default $PDTB_DIR): anywhere else (the root namespace, another namespace) the
    processes of the namespace are not the testbed's, so nothing is touched. The namespace of
    pid 1 cannot be the test: it may be unreadable (then every process would look "elsewhere")."""
    state_dir = state_dir or os.environ.get("PDTB_DIR") or DEFAULT_STATE_DIR
    tb = Testbed.load(state_dir)
    own = _pid_netns_inode(os.getpid())
    hosts = {_netns_inode(h.netns): h for h in tb.hosts} if tb is not None else {}
    hosts.pop(0, None)
    if own == 0 or own not in hosts:
        print(
            f"stop-host: this process is not on a host of the testbed recorded in {state_dir}; "
            "nothing stopped (the real `ray stop` would stop every Ray process on the machine)",
            file=sys.stderr,
        )
        return 1
    from ray.autoscaler._private.constants import RAY_PROCESSES

    ancestors = set()
    pid = os.getpid()
    while pid > 1:
        ancestors.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().split(") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    victims = []
    for pid in _pids_in_netns({own}):
        if pid in ancestors:
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(str(keyword) in (comm if by_name else args) for keyword, by_name in RAY_PROCESSES):
            victims.append(pid)
    _kill_pids(victims, grace_s)
    print(f"stopped {len(victims)} Ray processes on {hosts[own].name}")
    return 0


# -- CLI -------------------------------------------------------------------------------------


def add_testbed_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "testbed",
        help="a cluster on this machine: hosts as network namespaces (root, Linux)",
        description="Hosts as network namespaces on a bridge, each running what a real node runs "
        "(cluster/testbed.yaml). See cluster/README.md, 'A cluster on one machine'.",
    )
    commands = parser.add_subparsers(dest="testbed_command", required=True, metavar="{up,down,status,serve-config}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prefix", default=DEFAULT_PREFIX, help="names of namespaces and links")
        p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state file, homes, logs, Ray temp dirs")

    p = commands.add_parser("up", help="make the hosts and start Ray, Redis and Serve's proxy on them")
    common(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill hosts")
    p.add_argument("--decode", type=int, default=1, help="decode hosts")
    p.add_argument("--rate", default=DEFAULT_RATE, help="each host's link rate (tc tbf), e.g. 1gbit, 200mbit")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help="the /24's first three octets")
    p.add_argument(
        "--no-ray", action="store_true", help="hosts (and sshd) only: start Ray with `ray up cluster/testbed.yaml`"
    )
    p.add_argument("--sshd", dest="sshd", action="store_true", default=None, help="an sshd on every host")
    p.add_argument("--no-sshd", dest="sshd", action="store_false")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the cluster to come up")
    p.set_defaults(handler=_run_testbed)

    p = commands.add_parser("down", help="remove every namespace, link and process of the testbed")
    common(p)
    p.set_defaults(handler=_run_testbed)

    p = commands.add_parser("status", help="hosts, links, processes, Ray nodes")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_run_testbed)

    p = commands.add_parser("serve-config", help="print a Serve config (YAML) for this testbed")
    common(p)
    p.add_argument("--model", required=True, help="a model directory every host can read (e.g. under /tmp)")
    p.add_argument("--out", default=None, help="write it here instead of stdout")
    p.set_defaults(handler=_run_testbed)

    p = commands.add_parser("stop-host")  # unlisted: the `ray stop` of a testbed host (its `ray` wrapper)
    p.add_argument("--state-dir", default=None)
    p.set_defaults(handler=_run_testbed)


def _run_testbed(args: argparse.Namespace) -> int:
    command = args.testbed_command
    if command == "stop-host":
        return stop_host(args.state_dir)
    try:
        if command == "up":
            tb = up(
                args.prefix,
                args.subnet,
                args.prefill,
                args.decode,
                args.rate,
                args.state_dir,
                start_ray=not args.no_ray,
                sshd=args.sshd,
                timeout_s=args.timeout,
            )
            print(f"testbed {tb.prefix!r} is up; state in {tb.state_file}")
            if tb.ray:
                print(f"  Redis: {tb.redis_url}\n  Serve HTTP: {tb.http_url}\n  dashboard: {tb.dashboard_url}")
            else:
                print("  next: RAY_UP_enable_autoscaler_v2=0 ray up cluster/testbed.yaml -y --no-config-cache")
            return 0
        if command == "down":
            if not down(args.prefix, args.state_dir):
                print(f"testbed {args.prefix!r}: nothing to remove")
            return 0
        if command == "status":
            result = status(args.prefix, args.state_dir)
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                _print_status(result)
            return 0 if result["recorded"] else 1
        if command == "serve-config":
            import yaml

            recorded = Testbed.load(args.state_dir)
            if recorded is None:
                print(f"no testbed recorded in {args.state_dir}: run `pdserve testbed up` first", file=sys.stderr)
                return 1
            text = yaml.safe_dump(recorded.serve_config(str(Path(args.model).resolve())), sort_keys=False)
            if args.out:
                Path(args.out).write_text(text)
            else:
                print(text, end="")
            return 0
    except TestbedError as exc:
        print(f"pdserve testbed {command}: {exc}", file=sys.stderr)
        return 1
    raise AssertionError(command)


def _print_status(result: dict) -> None:
    if not result["recorded"]:
        print(
            f"testbed {result['prefix']!r}: none recorded in {result['state_file']}"
            + (
                f"; leftovers: {result['netns'] + result['links']} (pdserve testbed down removes them)"
                if result["netns"] or result["links"]
                else ""
            )
        )
        return
    print(f"testbed {result['prefix']!r} ({result['phase']}), links {result['rate']}")
    for h in result["hosts"]:
        print(
            f"  {h['name']:<12} {h['role']:<8} {h['ip']:<14} link {h['veth']} "
            f"{'up' if h['link_up'] else 'DOWN'}, {h['processes']} processes"
        )
    for key in ("gcs_address", "redis_url", "http_url", "dashboard_url", "ray_nodes_alive"):
        if key in result:
            print(f"  {key}: {result[key]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.testbed")
    add_testbed_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["testbed", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
