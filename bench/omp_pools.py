"""One OpenMP pool or two: an engine built on one thread and stepped on another (what a replica
did before its engine was built on the engine-loop thread) against one built and stepped on the
same thread, each in a fresh process, alternating.

    python bench/omp_pools.py                    # SmolLM2, 2 threads, 60 tokens, 3 rounds
    python bench/omp_pools.py --threads 2 --tokens 60 --rounds 3

libgomp keeps a pool of worker threads for every OS thread that starts a parallel region, and
once it manages more threads than the process's CPUs it stops spinning between regions. Each
line gives the wall time of one greedy request (a 280-token prompt, then ``--tokens`` decoded
tokens) and the voluntary context switches of the process's three busiest threads over it: a
worker that sleeps between ops switches once per op.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.idle import thread_switches  # noqa: E402

MODES = ("built-elsewhere", "built-on-the-stepping-thread")


def child(mode: str, model: str, threads: int, tokens: int) -> dict:
    import torch

    from workers.engine import LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = [LLMEngine(model, load_progress=False)] if mode == MODES[0] else []
    result: dict = {}

    def run() -> None:
        if not engine:
            engine.append(LLMEngine(model, load_progress=False))
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine[0].generate([[1] * 280], warm)
        before = thread_switches("self")
        start = time.perf_counter()
        engine[0].generate([[5] * 280], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        result["s"] = time.perf_counter() - start
        after = thread_switches("self")
        result["switches"] = sorted(after[k] - before.get(k, 0) for k in after)[-3:]

    thread = threading.Thread(target=run, name="engine-loop")
    thread.start()
    thread.join()
    return result


def main() -> None:
    from bench.models import MODEL_HELP, bench_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts.model, opts.threads, opts.tokens)))
        return
    model = bench_model_dir(opts.model, lambda p: p, Path("/nonexistent"))
    print(f"# bench/omp_pools.py --threads {opts.threads} --tokens {opts.tokens}; load {os.getloadavg()}")
    print("| round | engine | request (s) | voluntary context switches, 3 busiest threads |")
    print("|---|---|---|---|")
    for r in range(opts.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--model", model]
            cmd += ["--threads", str(opts.threads), "--tokens", str(opts.tokens)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            print(f"| {r + 1} | {mode} | {out['s']:.2f} | {out['switches']} |", flush=True)
    print(f"# load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
