"""Processes: commands run here, the processes inside the testbed's namespaces, and signalling them.

A namespace's processes are found by its nsfs inode (`/proc/<pid>/ns/net`), which stays known
after a crash: the state file records it as the namespace is made.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from typing import Any

from cluster.testbed.plan import TestbedError


def _run(argv: list[str], check: bool = True, timeout_s: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    if check and proc.returncode != 0:
        output = proc.stderr.strip() or proc.stdout.strip()
        raise TestbedError(f"{shlex.join(argv)} failed ({proc.returncode}): {output}")
    return proc


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
