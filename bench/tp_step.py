"""Tensor-parallel decode step on this machine: TP 1 vs TP 2, interleaved step by step in one run,
and where a TP-2 step's time goes on rank 0 (torch.profiler): the step's input broadcast, the
model's collectives (all-reduce, all-gather), and the rest (compute and host).

    python bench/tp_step.py                         # ~137M random llama (SmolLM2's size, 8/4 heads)
    python bench/tp_step.py --batches 1 8 32 --context 512 --steps 20

SmolLM2-135M itself has 9 query and 3 KV heads, which no TP of 2 divides (TP 3 would, on more
than 2 cores), so the model is a random llama of its size with 8 query / 4 KV heads of 72: 30
layers x 576, MLP 1536, 49152-token tied vocabulary. TP 1 runs torch with every core; each TP-2
rank with half of them, so both use the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import decode_step_table, start_decodes, stop_decodes  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402

MODEL_DIR = Path(".cache/bench-tp-llama")


def tp_model(path: Path) -> Path:
    from workers.models.tiny import make_tiny_model

    if not (path / "config.json").is_file():
        make_tiny_model(
            path,
            arch="llama",
            num_layers=30,
            hidden_size=576,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            seed=0,
        )
    return path


class Threads:
    """An engine whose steps run with ``threads`` torch threads in this process (the count is
    process-wide: TP 1 gets every core, rank 0 of TP 2 its half)."""

    def __init__(self, engine: LLMEngine, threads: int) -> None:
        self.engine, self.threads = engine, threads

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self):
        torch.set_num_threads(self.threads)
        return self.engine.step()


def rank0_breakdown(engine: LLMEngine, steps: int) -> dict[str, float]:
    """ms per step on rank 0: the input broadcast, the model's collectives, everything else."""
    import time

    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    parts = {"step input broadcast": 0.0, "model collectives": 0.0}
    for event in prof.key_averages():
        key = event.key.lower()
        ms = event.cpu_time_total / 1e3 / steps  # collectives: their wall on the calling thread
        if not key.startswith("gloo:") and not key.startswith("nccl:"):
            continue
        parts["step input broadcast" if "broadcast" in key else "model collectives"] += ms
    parts["compute + host (rest)"] = max(0.0, wall - sum(parts.values()))
    parts["wall"] = wall
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    model = str(tp_model(MODEL_DIR))
    print(
        f"# {platform.machine()}, {cores} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}; "
        f"model {model} (30 x 576, 8/4 heads, fp32)",
        flush=True,
    )
    common = dict(num_kv_blocks=2048, max_num_seqs=max(opts.batches), load_progress=False)
    half = max(1, cores // 2)
    torch.set_num_threads(half)  # what each TP-2 rank gets (its worker takes rank 0's count)
    tp2 = Threads(LLMEngine(model, tensor_parallel_size=2, **common), half)
    tp1 = Threads(LLMEngine(model, **common), cores)
    try:
        engines: dict = {"tp1": tp1, "tp2": tp2}
        results = decode_step_table(engines, opts.batches, opts.context, opts.steps, False)
        print("\nrank 0 of TP 2, ms per decode step (profiler adds some to every row):")
        for batch in opts.batches:
            start_decodes(tp2, batch, opts.context, "prof")
            parts = rank0_breakdown(tp2, max(3, opts.steps // 2))
            stop_decodes(tp2)
            results[f"tp2_breakdown_b{batch}"] = parts
            print(f"  batch {batch:>3}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        print(f"# load after: {os.getloadavg()[0]:.2f}")
    finally:
        tp2.engine.close()
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
