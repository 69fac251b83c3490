"""The testbed's network: namespaces on a bridge, one veth link each, rates, IPv6 off.

Each host is a network namespace with one veth link to a Linux bridge in the root namespace, its
own address on a private /24 (default 10.231.0.0/24: the bridge .1, the head .10, prefill hosts
.11-.19, decode hosts .21-.29), `lo` up, and a token-bucket rate on its link (`tc qdisc tbf`,
both directions; 1gbit by default). Nothing routes out of that /24: the namespaces have no
default route and the root namespace does not forward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.testbed.plan import _NS_IFACE, Host, TestbedError
from cluster.testbed.processes import _run

if TYPE_CHECKING:
    from cluster.testbed.control import Testbed


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


# -- rates -----------------------------------------------------------------------------------


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


# -- what exists -----------------------------------------------------------------------------


def _netns_inode(name: str) -> int:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return 0


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


def _link_is_up(link: str) -> bool:
    flags = _run(["ip", "-o", "link", "show", link], check=False).stdout.split("<", 1)[-1].split(">", 1)[0]
    return "UP" in flags.split(",")


# -- making it -------------------------------------------------------------------------------


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
