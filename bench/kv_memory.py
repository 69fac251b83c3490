"""KV memory benchmark: what a fixed KV budget holds and how fast it decodes, per KV cache dtype.

    python bench/kv_memory.py                       # ~100M-param llama (12 x 768), CPU, fp32
    python bench/kv_memory.py --device cuda --dtype bfloat16 --budget-gib 2

For each of auto / int8 / fp8, one engine with the same ``--budget-gib`` of KV cache:

- capacity: blocks allocated, and a run admitting ``--requests`` sequences of ``--context``
  tokens (half prompt, half output) at once: the most that ran together, the preemptions it
  took, and its output tokens/s (what the budget's concurrency buys end to end);
- decode speed: output tokens/s of a ``--batch`` of sequences decoding together in an engine
  with blocks to spare (the cost of quantizing on write and dequantizing on read, alone).

The ``auto`` rows are the baseline measured in the same run; ratios are to it.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import bench_model, sync  # noqa: E402
from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.protocol import KV_CACHE_DTYPES as KINDS  # noqa: E402


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(length)] for _ in range(n)]  # in any vocab here


def capacity(engine: LLMEngine, requests: int, context: int) -> dict:
    """Admit ``requests`` sequences of ``context`` tokens; the most that ran at once."""
    prompt_len = context // 2
    params = SamplingParams(max_tokens=context - prompt_len, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts(requests, prompt_len, seed=1)):
        engine.add_request(f"cap-{i}", prompt, params)
    peak, generated = 0, 0
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        generated += len(engine.step())
        peak = max(peak, len(engine.scheduler.running))
    sync(engine.device)
    elapsed = time.perf_counter() - start
    engine.block_manager.check_idle()
    return {"peak_running": peak, "preemptions": engine.scheduler.num_preemptions, "budget_tok_s": generated / elapsed}


def decode_throughput(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts(batch, prompt_len, seed=2)):
        engine.add_request(f"dec-{i}", prompt, params)
    sched = engine.scheduler
    while any(seq.num_output_tokens == 0 for seq in [*sched.waiting, *sched.running]):
        engine.step()  # prefills and first tokens, not timed
    sync(engine.device)
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        n += len(engine.step())
    sync(engine.device)
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--budget-gib", type=float, default=0.1, help="KV cache memory per engine")
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence in the capacity run")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = bench_model_dir(args.model, bench_model, Path(".cache/bench-llama-100m"))
    device = torch.device(args.device)
    rows = {}
    for kind in KINDS:
        # The same byte budget for every dtype, as num_kv_blocks (on CUDA the engine would
        # otherwise size the cache by gpu_memory_utilization of the whole GPU).
        probe = LLMEngine(
            model, device=args.device, dtype=args.dtype, kv_cache_dtype=kind, num_kv_blocks=1, load_progress=False
        )
        per_block = sum(t[:, :1].numel() * t.element_size() for t in probe.kv_caches)
        num_blocks = int(args.budget_gib * 2**30) // per_block
        del probe
        engine = LLMEngine(
            model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=kind,
            num_kv_blocks=num_blocks,
            max_num_seqs=max(args.requests, args.batch),
            load_progress=False,
        )
        cap = capacity(engine, args.requests, args.context)
        storage = str(engine.kv.dtype).removeprefix("torch.")
        del engine
        blocks_per_seq = -(-(args.prompt_len + args.steps + 1) // 16)
        engine = LLMEngine(
            model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=kind,
            num_kv_blocks=args.batch * blocks_per_seq + 16,
            max_num_seqs=args.batch,
            load_progress=False,
        )
        tput = max(decode_throughput(engine, args.batch, args.prompt_len, args.steps) for _ in range(2))
        rows[kind] = {
            "bytes_per_block": per_block,
            "blocks": num_blocks,
            **cap,
            "decode_tok_s": tput,
            "kv_dtype": storage,
        }
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()

    base = rows["auto"]
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}, model {model}"
    )
    print(
        f"KV budget {args.budget_gib:g} GiB per engine; capacity run: {args.requests} sequences x "
        f"{args.context} tokens; decode speed: batch {args.batch}, prompt {args.prompt_len}, "
        f"best of 2 x {args.steps} steps, blocks to spare\n"
    )
    print(
        f"{'kv dtype':<10}{'storage':>14}{'bytes/block':>13}{'blocks':>9}{'ratio':>7}{'peak running':>14}"
        f"{'preemptions':>13}{'tok/s in budget':>17}{'ratio':>7}{'decode tok/s':>14}{'ratio':>7}"
    )
    for kind, r in rows.items():
        print(
            f"{kind:<10}{r['kv_dtype']:>14}{r['bytes_per_block']:>13,}{r['blocks']:>9,}"
            f"{r['blocks'] / base['blocks']:>7.2f}{r['peak_running']:>14}{r['preemptions']:>13}"
            f"{r['budget_tok_s']:>17.1f}{r['budget_tok_s'] / base['budget_tok_s']:>7.2f}"
            f"{r['decode_tok_s']:>14.1f}{r['decode_tok_s'] / base['decode_tok_s']:>7.2f}"
        )


if __name__ == "__main__":
    main()
