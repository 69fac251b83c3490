"""A cluster on one machine: hosts as network namespaces on a bridge (`pdserve testbed up|down|status`).

Each host is a network namespace with its own address on a private /24, linked to a bridge at a
token-bucket rate; on each runs what a real node runs (cluster/testbed.yaml's start commands),
and everything made is recorded in a state file, so `down` removes all of it, also after a
crash. By concern:

    plan.py        hosts, names, addresses, ports; what this machine must have
    state.py       the record: the state file, where things are (TestbedState)
    control.py     Testbed: commands on hosts, link counters and faults, host loss, Ray and Serve
    network.py     namespaces, the bridge, veth links, tc rates, IPv6 off, the subnet check
    processes.py   commands run here, the processes in a namespace, signals
    home.py        the hosts' HOME: .bashrc and the `ray`, `ssh` and session wrappers
    sshd.py        an sshd on every host (for `ray up cluster/testbed.yaml`)
    startup.py     testbed.yaml's start commands run inside the namespaces (Ray, Redis, proxy)
    lifecycle.py   up, down, status
    ray_stop.py    stop_host: `ray stop` of one host (the hosts' `ray` wrapper)
    cli.py         `pdserve testbed ...` and `python -m cluster.testbed ...`
"""

from cluster.testbed.cli import _print_status as _print_status
from cluster.testbed.cli import _run_testbed as _run_testbed
from cluster.testbed.cli import add_testbed_parser, main
from cluster.testbed.control import Testbed
from cluster.testbed.home import _write_files as _write_files
from cluster.testbed.lifecycle import _port_open as _port_open
from cluster.testbed.lifecycle import _print_start_logs as _print_start_logs
from cluster.testbed.lifecycle import _remove_ray_up_caches as _remove_ray_up_caches
from cluster.testbed.lifecycle import down, status, up
from cluster.testbed.network import _link_is_up as _link_is_up
from cluster.testbed.network import _link_names as _link_names
from cluster.testbed.network import _make_network as _make_network
from cluster.testbed.network import _netns_inode as _netns_inode
from cluster.testbed.network import _netns_names as _netns_names
from cluster.testbed.network import _no_ipv6 as _no_ipv6
from cluster.testbed.network import _rate_bits as _rate_bits
from cluster.testbed.network import _tbf_argv as _tbf_argv
from cluster.testbed.network import check_subnet
from cluster.testbed.plan import _NS_IFACE as _NS_IFACE
from cluster.testbed.plan import _SYS_PATH as _SYS_PATH
from cluster.testbed.plan import (
    DASHBOARD_PORT,
    DECODE_OCTET,
    DEFAULT_PREFIX,
    DEFAULT_RATE,
    DEFAULT_STATE_DIR,
    DEFAULT_SUBNET,
    GCS_PORT,
    HEAD_OCTET,
    HTTP_PORT,
    MAX_PER_ROLE,
    PREFILL_OCTET,
    REDIS_PORT,
    SSHD,
    TESTBED_YAML,
    Host,
    TestbedError,
    check_environment,
    plan_hosts,
)
from cluster.testbed.processes import _alive as _alive
from cluster.testbed.processes import _all_pids as _all_pids
from cluster.testbed.processes import _kill_pids as _kill_pids
from cluster.testbed.processes import _pid_netns_inode as _pid_netns_inode
from cluster.testbed.processes import _pids_in_netns as _pids_in_netns
from cluster.testbed.processes import _run as _run
from cluster.testbed.processes import _signal as _signal
from cluster.testbed.ray_stop import stop_host
from cluster.testbed.sshd import _start_sshd as _start_sshd
from cluster.testbed.sshd import _wait_pidfile as _wait_pidfile
from cluster.testbed.startup import _record_pids as _record_pids
from cluster.testbed.startup import start_cluster, start_commands, yaml_commands
from cluster.testbed.state import TestbedState

__all__ = [
    "DASHBOARD_PORT",
    "DECODE_OCTET",
    "DEFAULT_PREFIX",
    "DEFAULT_RATE",
    "DEFAULT_STATE_DIR",
    "DEFAULT_SUBNET",
    "GCS_PORT",
    "HEAD_OCTET",
    "HTTP_PORT",
    "MAX_PER_ROLE",
    "PREFILL_OCTET",
    "REDIS_PORT",
    "SSHD",
    "TESTBED_YAML",
    "Host",
    "Testbed",
    "TestbedError",
    "TestbedState",
    "add_testbed_parser",
    "check_environment",
    "check_subnet",
    "down",
    "main",
    "plan_hosts",
    "start_cluster",
    "start_commands",
    "status",
    "stop_host",
    "up",
    "yaml_commands",
]
