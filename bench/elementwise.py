"""The engine's fused CPU kernels (``workers/backends/cpu/fused.py``) against aten's ops, which
they equal bit for bit.

(a) Each op alone at a few row counts, at the model's widths: the residual add with the RMSNorm
after it; rotary embedding of the fused q/k/v output's q and k heads (a strided view); the KV
cache write of k and v (strided views too); the greedy sampler's argmax over the vocabulary.

(b) The engine on a c8 workload, alone (no server): requests of random prompts, at most
``--concurrency`` in flight, a new one admitted as one finishes, as a served c8 run feeds it.
One engine, the kernels switched on and off between runs (its ops as ``CPUOps`` or the reference's ``Ops``), runs
interleaved; the medians and their ratio.

    .venv/bin/python bench/elementwise.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import MODEL_HELP  # noqa: E402
from workers.backends.cpu import fused as cpu_fused  # noqa: E402
from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.models.config import ModelConfig  # noqa: E402
from workers.models.source import resolve_model  # noqa: E402


def per_call_us(fn, seconds: float = 0.3) -> float:
    for _ in range(3):
        fn()
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or reps < 5:
        fn()
        reps += 1
    return elapsed / reps * 1e6


def reference_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x + residual
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)


def reference_kv_write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    cache[0].index_copy_(0, slots, k)
    cache[1].index_copy_(0, slots, v)


def ops_table(cfg: ModelConfig, rows_list: list[int]) -> list[dict]:
    hidden, d = cfg.hidden_size, cfg.head_dim
    q_and_k, all_heads = cfg.num_heads + cfg.num_kv_heads, cfg.num_heads + 2 * cfg.num_kv_heads
    weight = torch.rand(hidden) + 0.5
    print(
        f"(a) one op, us a call (hidden {hidden}; {q_and_k} q and k heads of {d} out of {all_heads}; "
        f"KV rows to random slots of 4096; argmax over {cfg.vocab_size})"
    )
    print(f"{'op':>16} {'rows':>6} {'aten':>10} {'fused':>10} {'ratio':>7}")
    results = []
    for rows in rows_list:
        x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
        heads = torch.randn(rows, all_heads, d)[:, :q_and_k]
        angles = torch.rand(rows, 1, d) * 100
        k, v = heads[:, cfg.num_heads :], heads[:, cfg.num_heads - cfg.num_kv_heads : cfg.num_heads]
        cache = torch.zeros(2, 4096, cfg.num_kv_heads, d)
        slots = torch.randperm(4096)[:rows]
        logits = torch.randn(rows, cfg.vocab_size)
        cos, sin = angles.cos(), angles.sin()
        cases = {
            "add + RMSNorm": (
                functools.partial(reference_add_norm, x, residual, weight, cfg.rms_norm_eps),
                functools.partial(cpu_fused.add_rms_norm, x, residual, weight, cfg.rms_norm_eps),
            ),
            "rotary": (
                functools.partial(cpu_fused.eager_rotary, heads, cos, sin),
                functools.partial(cpu_fused.rotary, heads, cos, sin),
            ),
            "KV write": (
                functools.partial(reference_kv_write, cache, slots, k, v),
                functools.partial(cpu_fused.kv_write, cache, slots, k, v),
            ),
        }
        if rows <= 64:  # the sampler's rows: one a sequence
            cases["greedy argmax"] = (
                functools.partial(torch.argmax, logits, -1),
                functools.partial(cpu_fused.argmax, logits),
            )
        for op, (aten, fused) in cases.items():
            a, f = per_call_us(aten), per_call_us(fused)
            print(f"{op:>16} {rows:>6} {a:>10.1f} {f:>10.1f} {a / f:>6.2f}x")
            results.append({"op": op, "rows": rows, "aten_us": a, "fused_us": f})
    return results


def c8_run(engine: LLMEngine, rng: random.Random, requests: int, concurrency: int, prompt: int, out: int):
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    pending = [[rng.randrange(100, vocab) for _ in range(prompt)] for _ in range(requests)]
    inflight = done = tokens = i = 0
    start, cpu = time.perf_counter(), time.process_time()
    while done < requests:
        while inflight < concurrency and pending:
            engine.add_request(f"r{i}", pending.pop(), params)
            i, inflight = i + 1, inflight + 1
        for o in engine.step():
            if o.finished:
                done, inflight, tokens = done + 1, inflight - 1, tokens + len(o.token_ids)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return tokens / wall, cpu / tokens * 1e3


def compare_c8(engine: LLMEngine, sides: tuple[str, str], switch, args: argparse.Namespace) -> None:
    """(b): the c8 workload on one engine switched between ``sides`` (``switch(side)`` before each
    run), ``args.rounds`` runs each, interleaved; each run, the medians, and the second side's
    over the first's."""
    rng = random.Random(0)
    c8_run(engine, rng, args.concurrency, args.concurrency, args.prompt_len, args.output_len)  # warm-up
    print(
        f"(b) engine alone: {args.requests} requests of {args.prompt_len} random tokens -> "
        f"{args.output_len}, {args.concurrency} in flight; interleaved runs"
    )
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in sides:
            switch(side)
            tps, cpu = c8_run(engine, rng, args.requests, args.concurrency, args.prompt_len, args.output_len)
            runs[side].append((tps, cpu))
            print(f"  {side:>8}: {tps:6.1f} tok/s, {cpu:6.2f} ms CPU a token", flush=True)
    med = {side: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for side, v in runs.items()}
    for side, (tps, cpu) in med.items():
        print(f"  median {side:>8}: {tps:6.1f} tok/s, {cpu:6.2f} ms CPU a token")
    first, second = sides
    print(
        f"  {second} / {first}: {med[second][0] / med[first][0]:.2f}x tok/s, "
        f"{med[second][1] / med[first][1]:.2f}x CPU a token"
    )


def add_c8_arguments(ap: argparse.ArgumentParser) -> None:
    """The options ``compare_c8`` reads, and ``--skip`` of the sections a and b."""
    ap.add_argument("--rounds", type=int, default=4, help="runs (or rounds) per side, interleaved")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--skip", nargs="*", default=[], choices=("a", "b"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP.split("; 'tiny'")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256, 2048], help="(a): rows per call")
    add_c8_arguments(ap)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    if not (
        cpu_fused.norm_width()
        and cpu_fused.rotary_usable()
        and cpu_fused.argmax_usable()
        and cpu_fused.kv_write_usable()
    ):
        sys.exit("the fused kernels are not usable on this machine (see the log): nothing to compare")
    engine = LLMEngine(str(model_dir), load_progress=False)
    print(
        f"# {model_dir.name}, {args.threads} threads, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, norm sums in {cpu_fused.norm_width()}-float vectors"
    )
    if "a" not in args.skip:
        ops_table(engine.model_config, args.rows)
    if "b" not in args.skip:
        from workers.backends.base import Ops
        from workers.backends.cpu.backend import CPUOps

        ops = engine.backend.ops  # shared by every module and the step's attention
        compare_c8(
            engine, ("aten", "fused"), lambda side: setattr(ops, "__class__", CPUOps if side == "fused" else Ops), args
        )
        ops.__class__ = CPUOps


if __name__ == "__main__":
    main()
