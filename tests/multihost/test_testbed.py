"""The testbed's own promises: an `up` killed half-way leaves state that `down` (or the next
`up`) removes completely: namespaces, links and every process started in them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.conftest import _namespaces_unavailable

PREFIX, SUBNET, STATE_DIR = "pdtbk", "10.231.2", "/tmp/pdtbk"  # apart from the session's testbed


def _ours() -> tuple[list[str], list[str]]:
    from cluster.testbed import _link_names, _netns_names

    return (
        [n for n in _netns_names() if n.startswith(f"{PREFIX}-")],
        [n for n in _link_names() if n.startswith(f"{PREFIX}-")],
    )


@pytest.fixture
def crash_site():
    problem = _namespaces_unavailable()
    if problem:
        pytest.skip(f"multihost tests need network namespaces: {problem}")
    from cluster.testbed import down

    down(PREFIX, STATE_DIR)
    yield
    down(PREFIX, STATE_DIR)


def test_an_up_killed_half_way_is_cleaned_by_the_next_up_and_by_down(crash_site):
    from cluster.testbed import Testbed, _netns_inode, _pid_netns_inode, _pids_in_netns, down, up

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.testbed",
            "up",
            "--prefix",
            PREFIX,
            "--subnet",
            SUBNET,
            "--state-dir",
            STATE_DIR,
            "--no-sshd",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Kill `up` (SIGKILL: no cleanup of its own) once the head's Ray is starting in its namespace.
    deadline = time.monotonic() + 120
    stranded: list[int] = []
    while time.monotonic() < deadline and not stranded:
        time.sleep(0.2)
        if os.path.exists(f"/run/netns/{PREFIX}-head"):
            stranded = [p for p in _pids_in_netns({_netns_inode(f"{PREFIX}-head")}) if "gcs_server" in _comm(p)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert stranded, "the head's GCS never started"
    left_netns, left_links = _ours()
    assert f"{PREFIX}-head" in left_netns and f"{PREFIX}-br" in left_links
    assert Testbed.load(STATE_DIR) is not None  # the state file was written as things were made

    # A second `up` after the crash: it first removes every leftover of its prefix.
    said: list[str] = []
    tb = up(PREFIX, SUBNET, 1, 1, state_dir=STATE_DIR, start_ray=False, sshd=False, say=said.append)
    assert any("removed leftovers" in line for line in said), said
    assert not any(_pid_netns_inode(p) for p in stranded)  # the crashed run's processes are gone
    assert all(not _pids_in_netns({h.netns_inode}) for h in tb.hosts)  # fresh, empty hosts
    assert sorted(_ours()[0]) == sorted(h.netns for h in tb.hosts)

    # `down` removes everything it made.
    removed = down(PREFIX, STATE_DIR)
    assert any(r.startswith("netns ") for r in removed)
    assert _ours() == ([], [])
    assert not Path(STATE_DIR, "state.json").exists()


def test_loopback_redis_urls_are_recognised_and_refused_only_across_nodes():
    """The start-up check behind build_app (no namespaces needed)."""
    from deploy.args import loopback_redis_problem, redis_url_is_loopback

    for url in (
        "redis://127.0.0.1:6380/0",
        "redis://localhost:6380",
        "redis://:pw@127.0.0.2:6380/1",
        "redis://[::1]:6380/0",
        "rediss://0.0.0.0:6380/0",
    ):
        assert redis_url_is_loopback(url), url
    for url in ("redis://10.231.0.10:6380/0", "redis://redis.internal:6380/0", "rediss://[fd00::5]:6380"):
        assert not redis_url_is_loopback(url), url
    assert loopback_redis_problem("redis://127.0.0.1:6380/0", 1) is None  # one node: loopback is right
    assert loopback_redis_problem(None, 3) is None  # no index: route by load
    assert loopback_redis_problem("redis://10.231.0.10:6380/0", 3) is None
    problem = loopback_redis_problem("redis://:secret@localhost:6380/0", 3)
    assert "has 3 nodes" in problem and "redis://<head IP>:6380/0" in problem and "secret" not in problem


def _comm(pid: int) -> str:
    """A process's name, or "" once it has exited (its /proc entry goes with it)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""
