"""CPU fp32 decode steps as one loop of kernel calls (``workers/backends/cpu/lean_decode.py``) against
the same steps through the model's modules, in one engine switched between them
(``model.fast_decode`` set or None), runs interleaved.

(a) Decode steps alone: ``--batches`` sequences of ``--context`` random prompt tokens decoding
together; per round, ``--steps`` steps each way; the min and median step over all rounds.

(b) The engine on the c8 workload, alone (no server): ``--requests`` requests of random prompts,
at most ``--concurrency`` in flight, a new one admitted as one finishes (``bench/elementwise.py``'s
loop); medians of ``--rounds`` runs each way, and their ratio.

    .venv/bin/python bench/lean_decode.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.elementwise import add_c8_arguments, compare_c8  # noqa: E402
from bench.models import MODEL_HELP  # noqa: E402
from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.models.source import resolve_model  # noqa: E402

SIDES = {"modules": False, "lean": True}


def step_table(engine: LLMEngine, batches: list[int], context: int, steps: int, rounds: int, rng: random.Random):
    vocab = engine.model_config.vocab_size
    print(f"(a) decode steps, context {context}; {rounds} rounds of {steps} steps each way, interleaved (ms)")
    print(f"  {'batch':>5} {'lean min':>9} {'lean med':>9} {'modules min':>12} {'modules med':>12} {'ratio (med)':>12}")
    fast = engine.model.fast_decode
    for batch in batches:
        params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(context)], params)
        for _ in range(3):  # the prompts, then a warm step each way
            engine.step()
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(rounds):
            for side, on in SIDES.items():
                engine.model.fast_decode = fast if on else None
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    times[side].append((time.perf_counter() - start) * 1e3)
        engine.model.fast_decode = fast
        for rid in ids:
            engine.abort(rid)
        lean, mods = times["lean"], times["modules"]
        print(
            f"  {batch:>5} {min(lean):>9.1f} {statistics.median(lean):>9.1f} {min(mods):>12.1f} "
            f"{statistics.median(mods):>12.1f} {statistics.median(mods) / statistics.median(lean):>11.2f}x",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP.split("; 'tiny'")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="(a): sequences decoding together")
    ap.add_argument("--context", type=int, default=256, help="(a): prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=15, help="(a): steps each way per round")
    add_c8_arguments(ap)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    engine = LLMEngine(str(model_dir), load_progress=False)
    lean = engine.model.fast_decode
    if lean is None:
        sys.exit("decode steps cannot run the lean path here (see the engine's log): nothing to compare")
    print(
        f"# {model_dir.name}, {args.threads} threads, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, lean decode up to {lean.max_rows} rows"
    )
    rng = random.Random(0)
    if "a" not in args.skip:
        step_table(engine, args.batches, args.context, args.steps, args.rounds, rng)
    if "b" not in args.skip:
        compare_c8(
            engine,
            ("modules", "lean"),
            lambda side: setattr(engine.model, "fast_decode", lean if side == "lean" else None),
            args,
        )
        engine.model.fast_decode = lean


if __name__ == "__main__":
    main()
