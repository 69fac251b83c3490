"""Non-greedy sampling of one engine step: the batched sampler (``workers/engine/sampler.py``)
against drawing row by row as it did before (a copy of that loop below, the same-run baseline),
on SmolLM2's vocabulary, with the settings OpenAI clients commonly send.

    python bench/sampler.py
    python bench/sampler.py --device cuda --rows 1 8 64

Each figure is the median of --reps calls after 3 warm-ups, the step's tokens read back to the
host (what the engine does with them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.sampler import _sample_rows  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_p 0.9, top_k 50": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
}


def per_row(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator) -> list[int]:
    """The sampler before batching: each row alone, three reads back to the host per row."""
    out = []
    for row, p in zip(logits, params):
        raw, x = row, row / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[..., 0] = False
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            out.append(int(raw.argmax()))
            continue
        out.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return out


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    generator = torch.Generator(args.device).manual_seed(0)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"host: {platform.node()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, {args.device}")
    print("\n| setting | rows | per row ms | batched ms | speed-up |\n|---|---|---|---|---|")
    for name, p in SETTINGS.items():
        for n in args.rows:
            logits = torch.randn(n, args.vocab, device=args.device, generator=generator) * 4
            params = [p] * n
            old = timed(lambda x=logits, ps=params: per_row(x, ps, generator), args.reps)
            new = timed(lambda x=logits, ps=params: _sample_rows(x, ps, [generator] * len(ps)).tolist(), args.reps)
            print(f"| {name} | {n} | {old * 1e3:.2f} | {new * 1e3:.2f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
