"""`pdserve testbed up|down|status|serve-config` (and `python -m cluster.testbed`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.testbed.control import Testbed
from cluster.testbed.lifecycle import down, status, up
from cluster.testbed.plan import DEFAULT_PREFIX, DEFAULT_RATE, DEFAULT_STATE_DIR, DEFAULT_SUBNET, TestbedError
from cluster.testbed.ray_stop import stop_host


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
