"""pdserve across hosts, on this machine: a testbed of network-namespace hosts (cluster/testbed/)
joined by a bridge, each host running its own Ray node (the head: Ray head, the index's Redis on
its address, Serve's HTTP proxy; workers: `ray start --resources '{"prefill": 1}'` or decode).

Every test here is marked `multihost` and skipped, with the reason, where namespaces cannot be
made (not Linux, not root, no iproute2, `ip netns add` refused, no redis-server). The testbed
has its own prefix, /24 and state dir (not `pdserve testbed`'s defaults, so a testbed someone
brought up by hand is left alone) and is always taken down at the end of the session; a session
killed half-way leaves state that the next session's `up` removes first.

Hosts: 1 head + 2 prefill + 2 decode by default (host loss needs a survivor of each kind);
PDSERVE_MULTIHOST_HOSTS=1x1 asks for one of each (the tests that need two skip).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

PREFIX = "pdtbt"
SUBNET = "10.231.1"  # 10.231.1.0/24, only on the bridge this testbed makes
STATE_DIR = "/tmp/pdtbt"
APP = "pdserve"
MODEL_NAME = "tiny"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/multihost/" in str(item.fspath):
            item.add_marker(pytest.mark.multihost)


def _namespaces_unavailable() -> str | None:
    from cluster.testbed import check_environment

    problem = check_environment()
    if problem:
        return problem
    probe = f"{PREFIX}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _host_counts() -> tuple[int, int]:
    spec = os.environ.get("PDSERVE_MULTIHOST_HOSTS", "2x2")
    prefill, decode = (int(n) for n in spec.lower().split("x"))
    return prefill, decode


@pytest.fixture(scope="session")
def testbed() -> Iterator:
    problem = _namespaces_unavailable()
    if problem:
        pytest.skip(f"multihost tests need network namespaces: {problem}")
    from cluster.testbed import down, up

    num_prefill, num_decode = _host_counts()
    try:
        started = time.monotonic()
        tb = up(
            PREFIX,
            SUBNET,
            num_prefill,
            num_decode,
            rate="1gbit",
            state_dir=STATE_DIR,
            start_ray=True,
            sshd=False,
            timeout_s=300,
        )
        print(
            f"\ntestbed up in {time.monotonic() - started:.1f}s: "
            + ", ".join(f"{h.name} {h.ip} {h.role}" for h in tb.hosts)
        )
        yield tb
    finally:
        down(PREFIX, STATE_DIR)


@pytest.fixture(scope="session")
def wide_tiny_model(tmp_path_factory) -> str:
    """A tiny random llama with wide KV (4 layers x 8 KV heads x 32 dims, fp32: 128 KiB a block),
    so one transfer is megabytes, far above the links' background chatter. Under /tmp: every
    host reads the same directory."""
    from workers.models.tiny import make_tiny_model

    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("multihost") / "llama-wide",
            arch="llama",
            num_layers=4,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=8,
            seed=0,
        )
    )
