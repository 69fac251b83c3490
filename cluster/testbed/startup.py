"""Starting what runs on the hosts: cluster/testbed.yaml's start commands, inside each namespace.

What runs on each host is what a real node runs: `cluster/testbed.yaml`'s start commands (the
head: Ray head with its node IP, Redis for the prefix index bound to the head's address on 6380,
Serve's HTTP proxy on the head's address; a worker: `ray start --address <head>:6379
--node-ip-address <own> --resources '{"prefill": 1}'` or decode), run inside the host's
namespace (`ip netns exec`). With `--no-ray` only the hosts (and an sshd on each) come up, and
`ray up cluster/testbed.yaml` runs the same commands over ssh.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from cluster.testbed.plan import GCS_PORT, TESTBED_YAML, Host, TestbedError
from cluster.testbed.processes import _pids_in_netns

if TYPE_CHECKING:
    from cluster.testbed.control import Testbed


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
