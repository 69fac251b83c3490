"""The testbed's plan: which hosts, their names and addresses, and what this machine must have.

Each host gets its own address on a private /24 (default 10.231.0.0/24: the bridge .1, the head
.10, prefill hosts .11-.19, decode hosts .21-.29); its namespace and its link carry its name
(`<prefix>-head`, `<prefix>-p0`, `<prefix>-d0`, ...).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PREFIX = "pdtb"
DEFAULT_SUBNET = "10.231.0"  # a /24: <subnet>.1 the bridge, .10 the head, .11-.19 prefill, .21-.29 decode
DEFAULT_STATE_DIR = "/tmp/pdtb"
DEFAULT_RATE = "1gbit"
HEAD_OCTET, PREFILL_OCTET, DECODE_OCTET, MAX_PER_ROLE = 10, 11, 21, 9
GCS_PORT, REDIS_PORT, HTTP_PORT, DASHBOARD_PORT = 6379, 6380, 8000, 8265
TESTBED_YAML = Path(__file__).parents[1] / "testbed.yaml"  # cluster/testbed.yaml
SSHD = "/usr/sbin/sshd"
_NS_IFACE = "eth0"  # the host's end of its link, inside its namespace
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TestbedError(RuntimeError):
    pass


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
