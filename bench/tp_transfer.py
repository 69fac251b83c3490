"""KV transfer between tensor-parallel groups: bytes and time of one prompt's blocks from a
prefill group of ``p`` ranks to a decode group of ``d`` ranks, each rank its own process, each
(prefill rank, decode rank) pair of the head plan (``workers/transfer/tp_plan.py``) its own gloo
pair group, as between workers; 1 -> 1 measured in the same run as the baseline.

    python bench/tp_transfer.py                            # 2k-token prompt, pairs 1-1 1-2 2-1 2-2
    python bench/tp_transfer.py --tokens 4096 --reps 7 --pairs 1-2 2-2

A prefill rank sends to each of its decode peers from a thread per peer (so 1 -> 2 sends both
halves at once), and a decode rank receives from each of its prefill peers likewise. Time: from a barrier all ranks pass
until the last decode rank has scattered its blocks, the median of ``--reps`` after a warm-up.
The model shape is SmolLM2-135M's (30 layers, head_dim 64, fp32) with 4 KV heads instead of its 3,
which no TP of 2 divides.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.local import find_free_port  # noqa: E402
from workers.protocol import KVLayout  # noqa: E402
from workers.transfer.config import Transport  # noqa: E402
from workers.transfer.pair import DECODE_RANK, PREFILL_RANK, PairGroup  # noqa: E402
from workers.transfer.tp_plan import heads_of_rank, plan_tp_transfer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 4, 64, 16


def _rank_main(side: str, rank: int, p: int, d: int, tokens: int, reps: int, port: int, out) -> None:
    torch.set_num_threads(1)
    plan = plan_tp_transfer(KV_HEADS, p, d)
    tp = p if side == "p" else d
    heads = heads_of_rank(KV_HEADS, tp, rank)
    layout = KVLayout(LAYERS, BLOCK, len(heads), HEAD_DIM, "float32")
    n = -(-tokens // BLOCK)
    caches = [torch.randn(2, n + 8, BLOCK, len(heads), HEAD_DIM) for _ in range(LAYERS)]
    blocks = list(range(n))
    deadline = time.monotonic() + 600
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    groups: dict[tuple[int, int], PairGroup] = {}
    for pair in plan.pairs:  # every rank walks the pairs in the same order: no rendezvous cycle
        if (side == "p" and pair[0] == rank) or (side == "d" and pair[1] == rank):
            groups[pair] = PairGroup.create(
                store_host="127.0.0.1",
                store_port=port,
                bind_host="127.0.0.1",
                peer_id=f"{pair}",
                decode_worker_id=f"d{pair[1]}-p{pair[0]}",
                epoch=1,
                rank=PREFILL_RANK if side == "p" else DECODE_RANK,
                transport=Transport.GLOO,
                device=torch.device("cpu"),
                deadline=deadline,
                buffer_cache_bytes=1 << 30,
            )

    def transfer(pair: tuple[int, int], moved: list[int]) -> None:
        """This rank's slices with one peer (list.append is atomic across threads)."""
        for s in plan.slices:
            if (s.prefill_rank, s.decode_rank) != pair:
                continue
            if side == "p":
                moved.append(groups[pair].send(caches, blocks, layout, s.dst.start, deadline, heads=s.src))
            else:
                moved.append(groups[pair].recv(caches, blocks, layout, s.dst.start, deadline, heads=s.dst))

    world = p + d
    me = rank if side == "p" else p + rank
    times, nbytes = [], 0
    for rep in range(reps + 1):
        store.add(f"barrier/{rep}", 1)
        while store.add(f"barrier/{rep}", 0) < world:
            time.sleep(0.0005)
        start = time.perf_counter()
        moved: list[int] = []
        threads = [threading.Thread(target=transfer, args=(pair, moved)) for pair in groups]  # one per peer
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if rep:
            times.append(elapsed)
            nbytes = sum(moved)
    for group in groups.values():
        group.close()
    out.put((side, rank, me, nbytes, times))


def measure(p: int, d: int, tokens: int, reps: int) -> dict:
    ctx = mp.get_context("spawn")
    port = find_free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=("p", r, p, d, tokens, reps, port, out)) for r in range(p)]
    procs += [ctx.Process(target=_rank_main, args=("d", r, p, d, tokens, reps, port, out)) for r in range(d)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=900) for _ in procs]
    for proc in procs:
        proc.join(60)
    del master
    received = {r: (nbytes, times) for side, r, _, nbytes, times in results if side == "d"}
    per_rep = [max(received[r][1][i] for r in received) for i in range(reps)]  # the last decode rank done
    total = sum(nbytes for nbytes, _ in received.values())
    return {
        "pair": f"{p}->{d}",
        "pairs": len(plan_tp_transfer(KV_HEADS, p, d).pairs),
        "bytes_per_decode_rank": [received[r][0] for r in sorted(received)],
        "bytes_total": total,
        "median_ms": statistics.median(per_rep) * 1000,
        "min_ms": min(per_rep) * 1000,
        "gb_per_s": total / statistics.median(per_rep) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pairs", nargs="+", default=["1-1", "1-2", "2-1", "2-2"], help="prefill-decode TP sizes")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}; "
        f"{opts.tokens}-token prompt, {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} fp32, gloo, "
        f"median of {opts.reps}",
        flush=True,
    )
    rows = []
    for spec in opts.pairs:
        p, d = (int(x) for x in spec.split("-"))
        rows.append(measure(p, d, opts.tokens, opts.reps))
    base = next((r for r in rows if r["pair"] == "1->1"), None)
    print(
        f"{'p->d':<6}{'pairs':>6}{'MB per decode rank':>22}{'MB total':>10}{'median ms':>11}{'GB/s':>7}{'vs 1->1':>9}"
    )
    for r in rows:
        per_rank = "/".join(f"{b / 1e6:.1f}" for b in r["bytes_per_decode_rank"])
        ratio = f"{base['median_ms'] / r['median_ms']:.2f}x" if base else "-"
        print(
            f"{r['pair']:<6}{r['pairs']:>6}{per_rank:>22}{r['bytes_total'] / 1e6:>10.1f}{r['median_ms']:>11.1f}"
            f"{r['gb_per_s']:>7.2f}{ratio:>9}"
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
