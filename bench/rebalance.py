"""KV pressure on decode replicas: preemption (rebalancing off) vs live moves (rebalancing on).

    python bench/rebalance.py [--model smollm2] [--requests 32] [--rate 4] [--kv-blocks 96]

Starts a local Ray and a managed redis-server and deploys 1 prefill + 2 decode replicas with a
small KV cache (``--kv-blocks`` per replica), once with ``kv_rebalance`` off and once on, and
sends each the same workload: ``--requests`` streamed completions arriving as a Poisson process
at ``--rate`` per second, prompts of ``--prompt-len`` tokens, answers of a length drawn from
``--lengths`` (``ignore_eos``, greedy). The decode router places each stream by its replica's
free blocks when it arrives, not by how long it will run, so one replica fills while the other
has room: off, it preempts (each preempted stream stalls for a recompute of prompt + tokens); on,
it moves a stream live to the other replica. Reported per run: preemptions and live moves (the
decode replicas' counters), p50/p99 of every stream's gaps between SSE events, the longest gap,
and output tokens per second over the run. Every answer is checked against the other run's.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.migrate import tiny_model, two_decode_app  # noqa: E402
from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from deploy.ops.loadgen.workloads import PromptMaker  # noqa: E402


def one(base: str, model: str, prompt: str, max_tokens: int, out: dict) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    times, text = [], []
    with httpx.stream("POST", f"{base}/v1/completions", json={**payload, "stream": True}, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event)
            times.append(time.perf_counter())
            text.extend(c["text"] for c in event.get("choices", []))
    out.update(text="".join(text), gaps=np.diff(times).tolist(), tokens=max_tokens)


def decode_counters(base: str) -> dict[str, int]:
    pools = httpx.get(f"{base}/v1/cluster/status", timeout=10).json()["pools"]["decode"]
    return {k: sum(int(r.get(k, 0)) for r in pools) for k in ("preemptions", "moved_out", "recomputed_prefills")}


def run(app_args: dict, port: int, workload: list[tuple[float, str, int]], label: str) -> dict:
    from ray import serve

    from deploy.builder import deploy_and_wait

    base = deploy_and_wait(app_args, "bench", "/", f"http://127.0.0.1:{port}", timeout_s=300)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    warm: dict = {}
    one(base, model, workload[0][1], 8, warm)
    before = decode_counters(base)
    results: list[dict] = [{} for _ in workload]
    threads = []
    start = time.perf_counter()
    for i, (at, prompt, max_tokens) in enumerate(workload):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        thread = threading.Thread(target=one, args=(base, model, prompt, max_tokens, results[i]), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(900)
    wall = time.perf_counter() - start
    after = decode_counters(base)
    serve.delete("bench")
    if any("text" not in r for r in results):
        raise RuntimeError(f"{label}: a request failed")
    gaps = np.concatenate([r["gaps"] for r in results]) * 1000
    row = {k: after[k] - before[k] for k in after} | {
        "itl_p50_ms": float(np.percentile(gaps, 50)),
        "itl_p99_ms": float(np.percentile(gaps, 99)),
        "max_gap_ms": float(gaps.max()),
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "wall_s": wall,
        "texts": [r["text"] for r in results],
    }
    print(
        f"  {label}: preemptions {row['preemptions']}, moves {row['moved_out']}, ITL p50 {row['itl_p50_ms']:.1f} "
        f"p99 {row['itl_p99_ms']:.1f} max {row['max_gap_ms']:.0f} ms, {row['tok_s']:.1f} tok/s",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--lengths", default="16,64,384", help="answer lengths, drawn uniformly")
    ap.add_argument("--kv-blocks", type=int, default=96, help="per replica, 16 tokens each")
    ap.add_argument("--cpus-per-replica", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)

    from cluster.local import LocalCluster, find_free_port

    model_dir = bench_model_dir(opts.model, tiny_model, Path(".cache/bench-migrate-llama"))
    maker = PromptMaker(model_dir)
    rng = np.random.default_rng(opts.seed)
    lengths = [int(x) for x in opts.lengths.split(",")]
    arrivals = np.cumsum(rng.exponential(1.0 / opts.rate, size=opts.requests))
    workload = [
        (float(at), maker.make(rng, opts.prompt_len)[0], int(rng.choice(lengths))) for at in arrivals - arrivals[0]
    ]
    port = find_free_port()
    with LocalCluster(num_cpus=8) as local:
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = two_decode_app(model_dir, local.redis_url, opts.kv_blocks, opts.cpus_per_replica)
        off = run({**app_args, "kv_rebalance": False}, port, workload, "rebalancing off")
        on = run({**app_args, "kv_rebalance": True}, port, workload, "rebalancing on")
        serve.shutdown()
    same = sum(a == b for a, b in zip(off.pop("texts"), on.pop("texts"), strict=True))
    print(
        f"\n### KV pressure: {opts.requests} requests at {opts.rate}/s, prompts {opts.prompt_len} tokens, "
        f"answers of {opts.lengths} tokens, {opts.kv_blocks} KV blocks per decode replica"
    )
    print(f"{'':<16}{'preempt':>8}{'moves':>7}{'ITL p50':>9}{'ITL p99':>9}{'max gap':>9}{'tok/s':>8}")
    for label, row in (("rebalancing off", off), ("rebalancing on", on)):
        print(
            f"{label:<16}{row['preemptions']:>8}{row['moved_out']:>7}{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>9.1f}"
            f"{row['max_gap_ms']:>9.0f}{row['tok_s']:>8.1f}"
        )
    print(
        f"on / off: ITL p99 {on['itl_p99_ms'] / off['itl_p99_ms']:.2f}x, throughput {on['tok_s'] / off['tok_s']:.2f}x; "
        f"answers identical: {same} of {opts.requests}"
    )
    if opts.json:
        opts.json.write_text(json.dumps({"off": off, "on": on, "options": vars(opts)}, indent=2))
    return 0 if same == opts.requests else 1


if __name__ == "__main__":
    sys.exit(main())
