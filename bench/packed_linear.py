"""A decode step's linears in eager mode: ``F.linear`` on plain fp32 weights against MKL's packed
GEMM (``torch.ops.mkl._mkl_linear`` on weights packed once per batch size, what inductor's
weight freezing uses on CPU) and oneDNN's (``torch.ops.mkldnn._linear_pointwise`` on weights
reordered once, for every batch size, with ``--onednn-hint`` as the batch-size hint: what the
engine's ``packed_linears`` uses), with SmolLM2-135M's shapes (30 layers of q/k/v/o and
gate/up/down, then the tied LM head), random weights, at each batch size and thread count.

    python bench/packed_linear.py                       # batches 1 8 32, threads 1 and 2
    python bench/packed_linear.py --batches 8 --threads 2 --rounds 5

Each figure is the minimum over ``--rounds`` rounds of ``--repeats`` steps, the two ways
alternating round by round. "equal" says whether the packed output equals ``F.linear``'s bit
for bit (on the LM head and a down projection): the engine's greedy output is held to
transformers' token for token, which runs ``F.linear``.

Batches of up to ``cpu_linear.MAX_ROWS`` rows also run the engine's panel kernel on its panel
copies of the weights (``workers/backends/cpu/panels.py``; a dash where it does not apply or did
not build), with the weights' bytes over its time (GB/s): a small batch only streams the weights.

    python bench/packed_linear.py --batches 1 2 4 8 16 --threads 2   # the panel kernel's range
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.backends.cpu import panels as cpu_linear  # noqa: E402

HIDDEN, INNER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M
SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INNER, HIDDEN),
    (INNER, HIDDEN),
    (HIDDEN, INNER),
]  # q, k, v, o, gate, up, down (down takes the inner width)


def plain(layers: list, head: torch.Tensor, x: torch.Tensor, xi: torch.Tensor) -> None:
    for layer in layers:
        for j, w in enumerate(layer):
            F.linear(xi if j == 6 else x, w)
    F.linear(x, head)


def packed_step(layers: list, packed: list, head, head_packed, x: torch.Tensor, xi: torch.Tensor, b: int) -> None:
    for layer, pl in zip(layers, packed):
        for j, (w, p) in enumerate(zip(layer, pl)):
            torch.ops.mkl._mkl_linear(xi if j == 6 else x, p, w, None, b)
    torch.ops.mkl._mkl_linear(x, head_packed, head, None, b)


def onednn_step(packed: list, head_packed, x: torch.Tensor, xi: torch.Tensor) -> None:
    for pl in packed:
        for j, p in enumerate(pl):
            torch.ops.mkldnn._linear_pointwise(xi if j == 6 else x, p, None, "none", [], "")
    torch.ops.mkldnn._linear_pointwise(x, head_packed, None, "none", [], "")


def panel_step(panels: list, head: torch.Tensor, x: torch.Tensor, xi: torch.Tensor) -> None:
    for layer in panels:
        for j, (w, n) in enumerate(layer):
            cpu_linear.linear(xi if j == 6 else x, w, n)
    cpu_linear.linear(x, head, VOCAB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--onednn-hint", type=int, default=8, help="the batch size oneDNN's one reorder is made for")
    opts = ap.parse_args()
    if not torch.backends.mkl.is_available():
        raise SystemExit("this torch has no MKL: nothing to compare")
    torch.manual_seed(0)
    layers = [[torch.randn(o, i) * 0.02 for o, i in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN) * 0.02
    print(f"# {os.uname().machine}, {os.cpu_count()} CPUs, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
    reorder = torch.ops.mkldnn._reorder_linear_weight
    onednn = [[reorder(w, opts.onednn_hint) for w in layer] for layer in layers]
    onednn_head = reorder(head, opts.onednn_hint)
    kernel = cpu_linear.available()
    panels = [[(cpu_linear.pack(w), w.shape[0]) for w in layer] for layer in layers] if kernel else []
    head_panels = cpu_linear.pack(head) if kernel else head
    print(
        "| batch | threads | F.linear (ms) | MKL packed per batch (ms) | plain / MKL | MKL equal "
        f"| oneDNN, one reorder (hint {opts.onednn_hint}) (ms) | plain / oneDNN | oneDNN equal "
        "| panel kernel (ms) | panel kernel GB/s | oneDNN / panel kernel |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    weight_bytes = (sum(o * i for o, i in SHAPES) * LAYERS + VOCAB * HIDDEN) * 4
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for b in opts.batches:
            x, xi = torch.randn(b, HIDDEN), torch.randn(b, INNER)
            packed = [[torch.ops.mkl._mkl_reorder_linear_weight(w, b) for w in layer] for layer in layers]
            head_packed = torch.ops.mkl._mkl_reorder_linear_weight(head, b)

            ways = {
                "plain": functools.partial(plain, layers, head, x, xi),
                "mkl": functools.partial(packed_step, layers, packed, head, head_packed, x, xi, b),
                "onednn": functools.partial(onednn_step, onednn, onednn_head, x, xi),
            }
            if kernel and cpu_linear.takes(x):
                ways["rows"] = functools.partial(panel_step, panels, head_panels, x, xi)
            equal = torch.equal(F.linear(x, head), torch.ops.mkl._mkl_linear(x, head_packed, head, None, b))
            equal &= torch.equal(
                F.linear(xi, layers[0][6]), torch.ops.mkl._mkl_linear(xi, packed[0][6], layers[0][6], None, b)
            )
            one_equal = torch.equal(
                F.linear(x, head), torch.ops.mkldnn._linear_pointwise(x, onednn_head, None, "none", [], "")
            )
            for fn in ways.values():  # warm
                fn()
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(opts.rounds):
                for name, fn in ways.items():
                    t = time.perf_counter()
                    for _ in range(opts.repeats):
                        fn()
                    best[name] = min(best[name], (time.perf_counter() - t) / opts.repeats * 1000)
            plain_ms, mkl_ms, one_ms = best["plain"], best["mkl"], best["onednn"]
            print(
                f"| {b} | {threads} | {plain_ms:.1f} | {mkl_ms:.1f} | {plain_ms / mkl_ms:.2f}x | {equal} "
                f"| {one_ms:.1f} | {plain_ms / one_ms:.2f}x | {one_equal} "
                + (
                    f"| {best['rows']:.1f} | {weight_bytes / best['rows'] / 1e6:.1f} | {one_ms / best['rows']:.2f}x |"
                    if "rows" in best
                    else "| — | — | — |"
                ),
                flush=True,
            )
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
