"""One layer's linears of SmolLM2-135M (q/k/v fused 960 x 576, o 576 x 576, gate/up fused 3072 x
576, down 576 x 1536) on coded weights (random weights through GGUF's Q4_1 and back, as ``pdserve
pull`` leaves SmolLM2's), at each row count: oneDNN's fp32 GEMM on its reordered copy (what wide
batches ran on before), the AMX kernel on the weight's tiles (``workers/backends/cpu/amx.py``) and,
up to ``cpu_linear.MAX_ROWS`` rows, the panel kernel on the coded panels. Each figure is the best
of ``--repeats`` calls, the ways taken in turn per weight; "err" is the worst ``|out - exact| /
sum |x w|`` against float64 over the four weights.

    python bench/amx_linear.py                              # rows 8 16 64 256 2048, 2 threads
    python bench/amx_linear.py --rows 1 4 8 16 32 64 --threads 1

Needs a CPU with AMX (the AMX column is skipped otherwise) and the ``gguf`` package.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.backends.cpu import amx as cpu_amx  # noqa: E402
from workers.backends.cpu import panels as cpu_linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down


def q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize, quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    kind = gguf.GGMLQuantizationType.Q4_1
    return torch.from_numpy(dequantize(quantize(w, kind), kind).reshape(n, k).copy())


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64, 256, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    amx = cpu_amx.available()
    weights = []
    for i, (n, k) in enumerate(SHAPES):
        w = q4_1(n, k, seed=i)
        coded = cpu_linear.code(w)
        assert coded is not None, "a Q4_1 weight must code"
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        weights.append((w, coded, cpu_amx.tiles(coded) if amx else None, packed))
    cpu = platform.processor() or platform.machine()
    print(
        f"# bench/amx_linear.py {' '.join(sys.argv[1:]) or '(defaults)'}; {cpu}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.threads} threads, AMX kernel {'on' if amx else 'unavailable'}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print("| rows | oneDNN (ms) | AMX (ms) | oneDNN / AMX | panel kernel (ms) | panel / AMX | err oneDNN | err AMX |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            took = {"onednn": 0.0, "amx": 0.0, "panel": 0.0}
            err = {"onednn": 0.0, "amx": 0.0}
            for w, coded, tiles, packed in weights:
                n, k = w.shape
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                ways = {"onednn": lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")}
                if tiles is not None:
                    ways["amx"] = lambda x=x, c=coded, t=tiles, n=n: cpu_amx.linear(x, c, t, n)
                if rows <= cpu_linear.MAX_ROWS:
                    ways["panel"] = lambda x=x, c=coded, n=n: cpu_linear.linear(x, c, n)
                for name, fn in ways.items():
                    took[name] += best(fn, args.repeats)
                exact = x.double() @ w.double().T
                scale = x.double().abs() @ w.double().abs().T
                for name in err:
                    if name in ways:
                        e = ((ways[name]().double() - exact).abs() / scale).max().item()
                        err[name] = max(err[name], e)
            ms = {k: v * 1e3 for k, v in took.items()}
            amx_ms = f"{ms['amx']:.2f}" if amx else "—"
            ratio = f"{ms['onednn'] / ms['amx']:.2f}x" if amx else "—"
            panel = f"{ms['panel']:.2f}" if rows <= cpu_linear.MAX_ROWS else "—"
            panel_ratio = f"{ms['panel'] / ms['amx']:.2f}x" if amx and rows <= cpu_linear.MAX_ROWS else "—"
            err_amx = f"{err['amx']:.1e}" if amx else "—"
            print(
                f"| {rows} | {ms['onednn']:.2f} | {amx_ms} | {ratio} | {panel} | {panel_ratio} | "
                f"{err['onednn']:.1e} | {err_amx} |"
            )


if __name__ == "__main__":
    main()
