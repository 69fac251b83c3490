"""`ray stop` on a testbed host: the testbed hosts' `ray` wrapper runs `python -m cluster.testbed
stop-host`, which stops only the calling host's Ray (the real `ray stop` stops every Ray process
on the machine: every testbed host, and any other Ray running here)."""

from __future__ import annotations

import os
import sys

from cluster.testbed.control import Testbed
from cluster.testbed.network import _netns_inode
from cluster.testbed.plan import DEFAULT_STATE_DIR
from cluster.testbed.processes import _kill_pids, _pid_netns_inode, _pids_in_netns


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
