"""Where an idle pdserve server's CPU goes: every process it started, and its busiest threads.

    python bench/idle.py                               # colocated SmolLM2, a 30 s window
    python bench/idle.py --server disagg --window-s 60 --threads 3
    python bench/idle.py --pdserve-arg=--haproxy       # one more `pdserve up` argument (repeatable)
    python bench/idle.py --server serve-floor          # Ray Serve in pdserve's shape, no model (bench/serve_floor.py)
    python bench/idle.py --server serve-floor --pdserve-arg=--ray-defaults   # ... on a plain ray.init

The server is started alone as ``bench/peer.py`` starts it (its own session; every descendant
remembered and stopped at the end), sent ``--requests`` short requests (one by default) so every lazy path has run, left
``--settle-s`` seconds, then the CPU time (user + system, ``/proc`` through psutil) of each of its
processes and their threads is read at the start and the end of ``--window-s`` seconds with no
request in flight. The table gives each process's share of one core over the window, busiest
first, its wake-ups a second (voluntary context switches of all its threads: a Ray worker's main
thread alone wakes 100 times a second), its role as ``bench/peer.py`` counts it and the threads
that used the most (their names as the kernel has them, ``/proc/<pid>/task/<tid>/comm``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peer import (  # noqa: E402
    Server,
    cpu_role,
    default_model,
    loadavg,
    machine_line,
    offline_env,
    pdserve_command,
    port_free,
    say,
)


@dataclass
class ProcessCPU:
    pid: int
    title: str  # the process's name and, where it has one, its command line (shortened)
    role: str
    seconds: float  # CPU seconds over the window
    threads: list[tuple[str, float]] = field(default_factory=list)  # (name, CPU seconds), busiest first
    wakes: float = 0.0  # voluntary context switches over the window, all its threads


def thread_name(pid: int, tid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return str(tid)


def thread_switches(pid: int | str) -> dict[str, int]:
    """Each live thread's voluntary context switches (times it went to sleep of its own accord,
    each a wake-up later), by thread id; ``pid`` may be "self". Empty where /proc no longer has
    the process."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[task.name] = int(line.split()[1])
    return out


def voluntary_switches(pid: int) -> int:
    """The process's voluntary context switches, summed over its live threads; 0 where /proc no
    longer has it."""
    return sum(thread_switches(pid).values())


Snapshot = dict[int, tuple[str, str, float, dict[str, float], int]]


def snapshot(procs: Mapping[int, Any]) -> Snapshot:
    """pid -> (title, role, CPU seconds, CPU seconds by thread name, voluntary context switches)
    of every live process."""
    import psutil

    out: Snapshot = {}
    for pid, p in procs.items():
        with contextlib.suppress(psutil.Error):
            name, cmdline = p.name(), " ".join(p.cmdline())
            times = p.cpu_times()
            by_thread: dict[str, float] = {}
            for t in p.threads():
                key = thread_name(pid, t.id)
                by_thread[key] = by_thread.get(key, 0.0) + t.user_time + t.system_time
            title = cmdline if cmdline.startswith("ray::") else f"{name} {cmdline}"
            cpu = times.user + times.system
            out[pid] = (title[:90], cpu_role(name, cmdline), cpu, by_thread, voluntary_switches(pid))
    return out


def window(before: Snapshot, after: Snapshot) -> list[ProcessCPU]:
    """Each process's CPU over the window (those alive at both reads), busiest first."""
    rows = []
    for pid, (title, role, seconds, threads, switches) in after.items():
        if pid not in before:
            continue
        prev_threads = before[pid][3]
        used = [(n, s - prev_threads.get(n, 0.0)) for n, s in threads.items()]
        used = sorted((u for u in used if u[1] > 0), key=lambda u: -u[1])
        wakes = max(0, switches - before[pid][4])
        rows.append(ProcessCPU(pid, title, role, max(0.0, seconds - before[pid][2]), used, wakes))
    return sorted(rows, key=lambda r: -r.seconds)


def format_window(rows: Sequence[ProcessCPU], seconds: float, threads: int) -> str:
    lines = [
        "| % of a core | wake-ups/s | role | process (pid) | busiest threads (% of a core) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        busiest = ", ".join(f"{n} {100 * s / seconds:.2f}" for n, s in r.threads[:threads])
        wakes = r.wakes / seconds
        lines.append(f"| {100 * r.seconds / seconds:.2f} | {wakes:.0f} | {r.role} | {r.title} ({r.pid}) | {busiest} |")
    total = sum(r.seconds for r in rows)
    by_role: dict[str, float] = {}
    for r in rows:
        by_role[r.role] = by_role.get(r.role, 0.0) + r.seconds
    roles = ", ".join(f"{role} {100 * s / seconds:.2f}" for role, s in sorted(by_role.items()))
    all_wakes = sum(r.wakes for r in rows) / seconds
    lines.append(f"| **{100 * total / seconds:.2f}** | {all_wakes:.0f} | all ({roles}) | {len(rows)} processes | |")
    return "\n".join(lines)


def send(base_url: str, model: str, n: int) -> None:
    """``n`` short greedy completions, one after another."""
    import httpx

    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    for _ in range(n):
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120, trust_env=False)
        r.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("colocated", "disagg", "serve-floor"), default="colocated")
    ap.add_argument("--model", default=None, help="model directory (default: `pdserve pull`'s SmolLM2)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=1, help="requests served before the settle")
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--windows", type=int, default=1, help="windows in a row, each printed")
    ap.add_argument("--threads", type=int, default=3, help="threads shown per process")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--pdserve-arg",
        action="append",
        default=[],
        help="one more argument for the server's command (`pdserve up`, or serve_floor.py's --ray-defaults)",
    )
    args = ap.parse_args(argv)

    model = Path(args.model or default_model())
    if not port_free(args.port):
        raise SystemExit(f"port {args.port} is taken: pass --port")
    if args.server == "serve-floor":
        floor = Path(__file__).resolve().parent / "serve_floor.py"
        cmd = [sys.executable, str(floor), "--port", str(args.port), "--served-model-name", args.served_model_name]
    else:
        cmd = pdserve_command(args.server, model, args.served_model_name, args.port, args.max_model_len)
    cmd += args.pdserve_arg
    log = Path(tempfile.gettempdir()) / f"pdserve-idle-{args.server}.log"
    server = Server(f"pdserve {args.server}", cmd, offline_env(os.environ), args.port, log)
    print(f"# {machine_line()}; load {' / '.join(f'{x:.2f}' for x in loadavg())}")
    print(f"# {' '.join(cmd)}")
    server.start()
    try:
        server.wait_ready(args.startup_timeout_s)
        send(f"http://127.0.0.1:{args.port}", args.served_model_name, args.requests)
        say(f"ready; {args.requests} request(s) served; settling {args.settle_s:g} s")
        time.sleep(args.settle_s)
        for i in range(args.windows):
            server.track()
            before = snapshot(server.seen)
            start = time.monotonic()
            time.sleep(args.window_s)
            server.track()
            after = snapshot(server.seen)
            elapsed = time.monotonic() - start
            print(f"\nwindow {i + 1}: {elapsed:.1f} s idle, load after {loadavg()[0]:.2f}")
            print(format_window(window(before, after), elapsed, args.threads))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
