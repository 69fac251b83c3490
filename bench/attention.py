"""Decode step time per attention backend (sdpa: gather + SDPA; flex: FlexAttention over the
physical cache; paged: one kernel per layer reading through the block tables, on CPU fp32 the C++
one of ``workers/backends/cpu/paged.py``; paged-inductor: the paged backend with inductor's kernel
instead, gather + SDPA below PAGED_MIN_KEYS keys), side by side in one run, each as a ratio to
sdpa.

    python bench/attention.py                                   # SmolLM2-135M and the tiny llama
    python bench/attention.py --models smollm2 --batches 8 --contexts 1024 --steps 10
    python bench/attention.py --backends sdpa paged             # leave flex out
    python bench/attention.py --models smollm2 --backends sdpa paged-inductor paged

A decode step here is what ``ModelRunner.execute`` runs for B decodes (the model's forward with
the step's K/V writes and attention in every layer, then the LM head), without the scheduler:
B sequences of ``context`` tokens each sit in random blocks of a cache filled with random K/V
(attention cost does not depend on the values), so no prefill has to run. Backends alternate
step by step over the same cache and tables; each figure is the median over ``--steps`` steps.
The header gives the load average: on a shared machine it says how much to trust them.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.backends.cpu.attention import CPUPagedAttention  # noqa: E402
from workers.backends.cpu.attention import warm_up as warm_up_cpu  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.layers.paged_attention import (  # noqa: E402
    PAGED_MIN_KEYS,
    AttentionMetadata,
    FlexPagedAttention,
    PagedAttention,
    warm_up_flex,
    warm_up_paged_decode,
)

TINY_DIR = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "bench-attention-tiny"


def model_dir(name: str) -> str:
    if name == "tiny":
        from workers.models.tiny import make_tiny_model

        if not (TINY_DIR / "config.json").is_file():
            make_tiny_model(TINY_DIR, arch="llama", seed=0)
        return str(TINY_DIR)
    from bench.models import bench_model_dir

    return bench_model_dir(name, lambda p: p, TINY_DIR)


def step_attention(engine: LLMEngine, kind: type[PagedAttention], tables, lens) -> PagedAttention:
    runner, kv = engine.runner, engine.kv
    bs, dev = kv.block_size, engine.device
    positions = [n - 1 for n in lens]
    write = kv.write_plan([t[p // bs] for t, p in zip(tables, positions)], [p % bs for p in positions], dev)
    meta = AttentionMetadata(write=write, sliding_window=runner.sliding_window)
    runner._fill_decode_metadata(meta, lens, [0] * len(lens), tables)
    return kind(kv, meta, engine.model.attention_scale)


@torch.inference_mode()
def decode_step(engine: LLMEngine, attn: PagedAttention, tokens: torch.Tensor, positions: torch.Tensor) -> float:
    start = time.perf_counter()
    hidden = engine.model(tokens, positions, attn)
    engine.model.compute_logits(hidden)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


MIN_KEYS = PAGED_MIN_KEYS  # --paged-min-keys


def _paged(kv, meta, scale, decode_kernel_on: bool = True):
    """The CPU backend's paged attention (``decode_kernel_on=False``: inductor's kernel on CPU
    fp32 too, what ran there before the C++ kernel, gather + SDPA below MIN_KEYS keys)."""
    return CPUPagedAttention(kv, meta, scale, min_keys=MIN_KEYS, decode_kernel_on=decode_kernel_on)


KINDS: dict[str, Callable[..., PagedAttention]] = {
    "sdpa": PagedAttention,
    "flex": FlexPagedAttention,
    "paged": _paged,
    "paged-inductor": functools.partial(_paged, decode_kernel_on=False),
}


def _warm_up_paged(kv, scale, heads, window) -> None:
    if not warm_up_cpu(kv, heads):
        warm_up_paged_decode(kv, scale, heads, window)


WARM_UPS = {
    "flex": warm_up_flex,
    "paged": _warm_up_paged,
    "paged-inductor": warm_up_paged_decode,
}


def run(name: str, backends: list[str], batches: list[int], contexts: list[int], steps: int, device: str) -> None:
    bs = 16
    blocks = max(batches) * -(-max(contexts) // bs) + 8
    engine = LLMEngine(
        model_dir(name), num_kv_blocks=blocks, attention_backend="sdpa", device=device, load_progress=False
    )
    kv = engine.kv
    gen = torch.Generator().manual_seed(0)
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
    compiled = []
    for backend in backends:
        if backend in WARM_UPS:
            t = time.perf_counter()
            heads, window = engine.model_config.num_heads, engine.runner.sliding_window
            WARM_UPS[backend](kv, engine.model.attention_scale, heads, window)
            compiled.append(f"{backend} compiled in {time.perf_counter() - t:.1f} s")
    cfg = engine.model_config
    print(
        f"\n{name}: {cfg.num_layers} layers, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, "
        f"cache {blocks} blocks; " + ("; ".join(compiled) or "nothing compiled")
    )
    others = [b for b in backends if b != "sdpa"]
    header = f"{'batch':>5} {'context':>7}" + "".join(f" {b + ' ms':>9}" for b in backends)
    print(header + "".join(f" {b + '/sdpa':>10}" for b in others if "sdpa" in backends))
    rng = random.Random(0)
    for batch in batches:
        for context in contexts:
            ids = rng.sample(range(blocks), batch * -(-context // bs))
            per = -(-context // bs)
            tables = [ids[i * per : (i + 1) * per] for i in range(batch)]
            lens = [context] * batch
            tokens = torch.tensor([rng.randrange(100, 1000) for _ in range(batch)], device=engine.device)
            positions = torch.tensor([n - 1 for n in lens], device=engine.device)
            times: dict[str, list[float]] = {b: [] for b in backends}
            for i in range(steps + 1):  # the first round warms up (not counted)
                order = backends[i % len(backends) :] + backends[: i % len(backends)]  # rotate who goes first
                for backend in order:
                    attn = step_attention(engine, KINDS[backend], tables, lens)
                    elapsed = decode_step(engine, attn, tokens, positions)
                    if i:
                        times[backend].append(elapsed)
            ms = {b: statistics.median(times[b]) * 1e3 for b in backends}
            line = f"{batch:>5} {context:>7}" + "".join(f" {ms[b]:>9.2f}" for b in backends)
            if "sdpa" in backends:
                line += "".join(f" {ms[b] / ms['sdpa']:>10.2f}" for b in others)
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], help="'smollm2', 'tiny' or a model dir")
    parser.add_argument("--backends", nargs="+", choices=sorted(KINDS), default=["sdpa", "flex", "paged"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per backend and point (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--paged-min-keys",
        type=int,
        default=None,
        help=f"paged: the kernel from this many keys a step, gather + SDPA below (default {PAGED_MIN_KEYS}; 0: always)",
    )
    args = parser.parse_args()
    global MIN_KEYS
    if args.paged_min_keys is not None:
        MIN_KEYS = args.paged_min_keys
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
        f"paged kernel from {MIN_KEYS} keys a step, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    for name in args.models:
        run(name, args.backends, args.batches, args.contexts, args.steps, args.device)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
