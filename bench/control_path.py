"""Per-request overhead of the disaggregated path, this tree against an earlier commit, measured
in one run on one machine:

    python bench/control_path.py --baseline 23b0dd2 [--requests 100] [--rounds 2]

For each tree (the baseline's code is checked out into a git worktree under /tmp) a child
process starts its own local Ray, deploys 1 prefill + 1 decode replica of a small random llama
(no Redis: routing by load, so every request takes the full prefill -> transfer -> decode path)
and measures, one request at a time:

* ingress -> first token (streamed completions, 64-token prompts, 2 output tokens): prefill;
* ingress -> done (the stream's ``[DONE]``, right after the second token): the first token plus
  the KV transfer and its control calls, then decode's first step (the disaggregated path's own
  overhead lives between the two; the ingress may send the first token's text with the second's);
* a control round trip to the prefill replica, as the decode side makes it: through the
  baseline's pinned Serve call (``release_kv.remote(..., target_replica=id)``) or this tree's
  KV control server (``ControlClient.release``), asking to release a lease nobody holds.

Rounds alternate the trees (baseline, this, baseline, this, ...) so drift in the machine's load
shows up as a difference between rounds, and the table gives each tree's median over rounds of
its p50 / p99, and this tree's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# ------------------------------------------------------------------------------------ child
def child(args: argparse.Namespace) -> None:
    import httpx
    import ray
    from ray import serve

    from bench.compare import bench_model  # the 4 x 256 random llama the serving comparisons use
    from deploy.builder import deploy_and_wait

    model = bench_model(Path(args.model_dir))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = args.port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_args = {
        "model": str(model),
        "served_model_name": "m",
        "device": "cpu",
        "num_kv_blocks": 512,
        "prefill": {"replicas": 1, "num_cpus": 1},
        "decode": {"replicas": 1, "num_cpus": 1},
    }
    base = deploy_and_wait(app_args, "bench", "/", f"http://127.0.0.1:{port}", timeout_s=300)
    rng = random.Random(7)

    def one(client: httpx.Client) -> tuple[float, float]:
        body = {
            "model": "m",
            "prompt": [rng.randrange(3, 2000) for _ in range(64)],
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        start = time.perf_counter()
        times = []
        with client.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    times.append(time.perf_counter() - start)  # the second token came before it
                elif line.startswith("data: ") and not times:
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(time.perf_counter() - start)
        if len(times) != 2:
            raise RuntimeError(f"expected a token chunk then [DONE], got {len(times)} marks")
        return times[0], times[1]

    with httpx.Client() as client:
        for _ in range(10):
            one(client)  # warm: pair group made, code paths hot
        firsts, seconds = [], []
        for _ in range(args.requests):
            a, b = one(client)
            firsts.append(a)
            seconds.append(b)
        status = client.get(f"{base}/v1/cluster/status", timeout=30).json()
    rtts = asyncio.run(control_round_trips(status, args.requests))
    pairs = status.get("pairs") or []
    print(
        json.dumps(
            {
                "ttft_s": firsts,
                "second_token_s": seconds,
                "control_rtt_s": rtts,
                "transfers": sum(p.get("transfers", 0) for p in pairs),
                "recomputes": sum(p.get("recomputed_prefills", 0) for p in pairs),
            }
        )
    )
    serve.shutdown()
    ray.shutdown()


async def control_round_trips(status: dict, n: int) -> list[float]:
    prefill_id = status["pools"]["prefill"][0]["worker_id"]
    try:
        from workers.transfer.control import ControlClient
    except ImportError:  # the baseline: a call pinned to the replica through Serve's router
        from ray import serve

        handle = serve.get_deployment_handle("prefill", "bench")

        async def call() -> None:
            await handle.release_kv.remote("bench-no-such-request", target_replica=prefill_id)
    else:
        from deploy.pools.directory import lookup

        address = (await lookup("bench", "prefill"))[prefill_id]
        client = ControlClient("bench")

        async def call() -> None:
            await client.release(address, "bench-no-such-request", 5.0)

    for _ in range(20):
        await call()
    rtts = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        rtts.append(time.perf_counter() - start)
    return rtts


# ----------------------------------------------------------------------------------- parent
def worktree(commit: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"pdserve-baseline-{commit}"
    if not (path / "pyproject.toml").is_file():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), commit],
            check=True,
            capture_output=True,
        )
    return path


def run_tree(tree: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "control_path.py"),
        "--child",
        "--requests",
        str(args.requests),
        "--model-dir",
        args.model_dir,
        "--port",
        str(args.port),
    ]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the benchmark child failed:\n{out.stderr[-4000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]  # Ray prints too
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="the commit to compare against (checked out into a git worktree)")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "pdserve-bench-tiny-llama"))
    parser.add_argument("--port", type=int, default=8711)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if not args.baseline:
        parser.error("--baseline COMMIT is required")
    trees = {"baseline": worktree(args.baseline), "this tree": ROOT}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            print(f"round {r + 1}/{args.rounds}: {name} ({tree}) ...", file=sys.stderr, flush=True)
            result = run_tree(tree, args)
            rows[name].append(result)
            print(
                f"  ttft p50 {statistics.median(result['ttft_s']) * 1e3:.1f} ms, done p50 "
                f"{statistics.median(result['second_token_s']) * 1e3:.1f} ms, control rtt p50 "
                f"{statistics.median(result['control_rtt_s']) * 1e3:.2f} ms; {result['transfers']} transfers, "
                f"{result['recomputes']} recomputes",
                file=sys.stderr,
                flush=True,
            )

    def summary(name: str, key: str, q: float) -> float:
        return statistics.median(percentile(row[key], q) for row in rows[name]) * 1e3

    print(f"\n{args.requests} requests per round, {args.rounds} rounds per tree (medians over rounds), ms")
    print(f"{'':28} {'baseline p50':>12} {'p99':>8} {'this p50':>9} {'p99':>8} {'ratio p50':>9} {'p99':>6}")
    for key, label in (
        ("ttft_s", "ingress -> first token"),
        ("second_token_s", "ingress -> done (2 tokens)"),
        ("control_rtt_s", "control round trip"),
    ):
        b50, b99 = summary("baseline", key, 50), summary("baseline", key, 99)
        t50, t99 = summary("this tree", key, 50), summary("this tree", key, 99)
        print(f"{label:28} {b50:12.2f} {b99:8.2f} {t50:9.2f} {t99:8.2f} {t50 / b50:9.2f} {t99 / b99:6.2f}")
    for name in trees:
        print(
            f"{name}: transfers {[r['transfers'] for r in rows[name]]}, recomputes "
            f"{[r['recomputes'] for r in rows[name]]}"
        )


if __name__ == "__main__":
    main()
