"""KV transfer through the prefill and decode workers, between tensor-parallel replicas: one
prompt's blocks from a prefill replica of ``p`` ranks to a decode replica of ``d`` ranks, each rank
its own process (the engine's local launcher), coordinated as in serving
(``workers/transfer/tp_transfer.py``: the Send with the rank pairs, one broadcast per transfer to
each side's worker ranks, every rank's report awaited). 1 -> 1 (the one-rank path) in the same
run is the baseline; ``bench/tp_transfer.py`` measures the bare pair groups.

    python bench/tp_pd_transfer.py                       # 2k-token prompt, 1-1 1-2 2-1 2-2, 5 reps
    python bench/tp_pd_transfer.py --tokens 4096 --reps 7 --pairs 1-2 2-1

Time is the decode worker's pull (``TransferStats.seconds``: from the Send until every decode
rank has written its blocks), the median of ``--reps`` fresh prompts (random ids, so nothing is
cached) after a warm-up. The model is bench/tp_step.py's: SmolLM2-135M's 30 layers x 576 with 8 heads
and 4 KV heads (head_dim 72), fp32, so every TP size here divides them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tp_step import MODEL_DIR, tp_model  # noqa: E402
from workers.decode import DecodeWorker  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.prefill import PrefillWorker  # noqa: E402
from workers.protocol import GenerateRequest  # noqa: E402
from workers.transfer import TransferConfig  # noqa: E402


async def measure(model: Path, p: int, d: int, tokens: int, reps: int, seed: int) -> dict:
    cfg = TransferConfig(transfer_timeout_s=120.0, connect_timeout_s=120.0)
    blocks = 2 * (tokens // 16 + 2)

    def engine(tp: int) -> LLMEngine:
        return LLMEngine(
            str(model),
            num_kv_blocks=blocks,
            tensor_parallel_size=tp,
            max_num_batched_tokens=tokens,
            load_progress=False,
        )

    prefill = PrefillWorker(engine(p), f"prefill-{p}{d}", cfg, lease_ttl_s=120.0)
    await prefill.start()
    decode = DecodeWorker(engine(d), f"decode-{p}{d}", cfg)
    rng = random.Random(seed)
    times: list[float] = []
    try:
        for rep in range(reps + 1):  # the first makes the pair groups: a warm-up
            prompt = tuple(rng.randrange(100, 40000) for _ in range(tokens))
            request = GenerateRequest(f"r{rep}", prompt, {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
            before = decode.stats.transfer_seconds
            result = await prefill.prefill(request)
            async for _ in decode.generate(request, result):
                pass
            if decode.stats.recomputed_prefills:
                raise RuntimeError(f"{p}->{d}: a transfer failed and was recomputed; no figure")
            if rep:
                times.append(decode.stats.transfer_seconds - before)
        rank_bytes = [b // (reps + 1) for b in decode.stats.transfer_rank_bytes] or [
            decode.stats.transfer_bytes // (reps + 1)
        ]
        return {
            "p": p,
            "d": d,
            "median_s": statistics.median(times),
            "min_s": min(times),
            "bytes": decode.stats.transfer_bytes // (reps + 1),
            "rank_bytes": rank_bytes,
        }
    finally:
        for worker in (prefill, decode):
            await worker.shutdown()
            worker.engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pairs", nargs="+", default=["1-1", "1-2", "2-1", "2-2"], help="prefill-decode TP sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = tp_model(ROOT / MODEL_DIR)
    sizes = [tuple(int(x) for x in pair.split("-")) for pair in args.pairs]
    if (1, 1) not in sizes:
        sizes.insert(0, (1, 1))  # the baseline, always in the same run
    load = os.getloadavg()[0]
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load {load:.2f}; "
        f"{args.tokens}-token prompt through PrefillWorker/DecodeWorker, gloo, median of {args.reps}"
    )
    rows = [
        asyncio.run(measure(model, p, d, args.tokens, args.reps, args.seed + 7 * i)) for i, (p, d) in enumerate(sizes)
    ]
    base = next(r for r in rows if (r["p"], r["d"]) == (1, 1))
    print(f"{'p->d':6} {'MB per decode rank':>20} {'MB total':>9} {'median ms':>10} {'min ms':>8} {'vs 1->1':>8}")
    for r in rows:
        per_rank = "/".join(f"{b / 1e6:.1f}" for b in r["rank_bytes"])
        ratio = base["median_s"] / r["median_s"]
        print(
            f"{r['p']}->{r['d']:<4} {per_rank:>20} {r['bytes'] / 1e6:9.1f} {r['median_s'] * 1e3:10.1f} "
            f"{r['min_s'] * 1e3:8.1f} {ratio:7.2f}x"
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": load, "rows": rows, "at": time.time()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
