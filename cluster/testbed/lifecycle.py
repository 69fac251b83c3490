"""A testbed's life: `up` (hosts, then what runs on them), `down` (all of it, also after a crash),
and `status`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from cluster.testbed.control import Testbed
from cluster.testbed.home import _write_files
from cluster.testbed.network import (
    _link_is_up,
    _link_names,
    _make_network,
    _netns_inode,
    _netns_names,
    _rate_bits,
    check_subnet,
)
from cluster.testbed.plan import (
    DASHBOARD_PORT,
    DEFAULT_PREFIX,
    DEFAULT_RATE,
    DEFAULT_STATE_DIR,
    DEFAULT_SUBNET,
    SSHD,
    TESTBED_YAML,
    Host,
    TestbedError,
    check_environment,
    plan_hosts,
)
from cluster.testbed.processes import _kill_pids, _pids_in_netns, _run
from cluster.testbed.sshd import _start_sshd
from cluster.testbed.startup import start_cluster

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


def _print_start_logs(tb: Testbed, say) -> None:
    for host in tb.hosts:
        log = tb.host_dir(host) / "start.log"
        if log.exists():
            say(f"--- {host.name} start.log (tail) ---\n" + "\n".join(log.read_text().splitlines()[-25:]))
