"""CPU prompt attention: ``cpu_prefill``'s kernel against SDPA (aten's flash kernel for CPU, what
the engine ran before), in one process, interleaved.

(a) The attention alone, SmolLM2's shapes (9 query heads over 3 KV heads of 64): a fresh prompt of
``--lengths`` tokens (SDPA with ``is_causal``), and ``--chunk`` new tokens after ``--cached``
cached ones (SDPA with the additive mask over a gathered copy, the kernel over the scattered
rows in place); min and median of ``--calls`` calls each way per round.

Then the engine's prompt pass (``bench/engine.py``'s ``prompt_pass``: one prompt of each of
``--lengths`` tokens to its first token, the engine caching no prefix), the kernel on and off
(the paged attention's ``prompt_kernel_on``), interleaved; min and median.

(b) The engine alone on the c8 workload (``bench/elementwise.py``'s ``compare_c8``), both ways.
``--skip a`` / ``--skip b`` leave a section out.

    .venv/bin/python bench/prompt_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.elementwise import add_c8_arguments, compare_c8  # noqa: E402
from bench.engine import prompt_pass  # noqa: E402
from bench.models import MODEL_HELP  # noqa: E402
from workers.backends.cpu import prefill as cpu_prefill  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.models.source import resolve_model  # noqa: E402

SIDES = ("sdpa", "kernel")


def _timed(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _row(label: str, times: dict[str, list[float]]) -> None:
    sdpa, kernel = times["sdpa"], times["kernel"]
    print(
        f"  {label:>22} {min(sdpa):>9.3f} {statistics.median(sdpa):>9.3f} {min(kernel):>11.3f} "
        f"{statistics.median(kernel):>11.3f} {statistics.median(sdpa) / statistics.median(kernel):>11.2f}x",
        flush=True,
    )


def _header(what: str) -> None:
    print(what)
    print(f"  {'':>22} {'sdpa min':>9} {'sdpa med':>9} {'kernel min':>11} {'kernel med':>11} {'ratio (med)':>12}")


def attention_table(args: argparse.Namespace) -> None:
    hq, hkv, d = 9, 3, 64
    scale = d**-0.5
    gen = torch.Generator().manual_seed(0)
    _header(
        f"(a) attention alone, {hq} q heads / {hkv} kv heads of {d}; {args.rounds} rounds x {args.calls} calls (ms)"
    )
    for n in args.lengths:
        q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
        _row(f"fresh {n}", _interleave(_fresh_calls(q, k, v, scale), args))
    n, cached = args.chunk, args.cached
    total = n + cached
    slots = 4 * total  # a cache with the sequence's slots scattered over it
    kc, vc = torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    rows = torch.randperm(slots, generator=gen)[:total]
    q = torch.randn(n, hq, d, generator=gen)
    qpos, kpos = torch.arange(cached, total)[:, None], torch.arange(total)[None, :]
    mask = torch.zeros(n, total).masked_fill_(kpos > qpos, float("-inf"))

    def sdpa_chunk():
        ks, vs = kc[rows], vc[rows]  # the gather the SDPA path makes
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            ks.transpose(0, 1)[None],
            vs.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )

    fns = {"sdpa": sdpa_chunk, "kernel": lambda: cpu_prefill.prefill_attention(q, kc, vc, rows, cached, 0, scale, None)}
    _row(f"{n} after {cached} cached", _interleave(fns, args))


def _fresh_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> dict:
    rows = torch.arange(q.shape[0])

    def sdpa():
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

    return {"sdpa": sdpa, "kernel": lambda: cpu_prefill.prefill_attention(q, k, v, rows, 0, 0, scale, None)}


def _interleave(fns: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    for fn in fns.values():
        _timed(fn, 3)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            times[side] += _timed(fns[side], args.calls)
    return times


def use_prompt_kernel(engine: LLMEngine, on: bool) -> None:
    """The engine's next steps run prompts through the kernel, or SDPA (its attention's option)."""
    engine.runner._attention = functools.partial(engine.runner._attention, prompt_kernel_on=on)


def prompt_pass_table(engine: LLMEngine, args: argparse.Namespace) -> None:
    _header(
        f"(a) the engine's prompt pass, a fresh prompt to its first token; {args.rounds} rounds x {args.passes} (ms)"
    )
    for n in args.lengths:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for side in SIDES:
                use_prompt_kernel(engine, side == "kernel")
                for i in range(args.passes):
                    # bench/engine.py's pass: the same prompt each time (the engine caches no prefix)
                    seconds = prompt_pass(engine, 1, n, f"{side}-{n}-{round_}-{i}")
                    if round_:
                        times[side].append(seconds * 1e3)
        use_prompt_kernel(engine, True)
        _row(f"prompt {n}", times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP.split("; 'tiny'")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024], help="(a): prompt tokens")
    ap.add_argument("--chunk", type=int, default=128, help="(a): new tokens after the cached ones")
    ap.add_argument("--cached", type=int, default=768, help="(a): cached tokens before the chunk")
    ap.add_argument("--calls", type=int, default=20, help="(a): calls each way per round")
    ap.add_argument("--passes", type=int, default=3, help="(a): prompt passes each way per round")
    add_c8_arguments(ap)
    ap.set_defaults(rounds=3)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    if not cpu_prefill.available(3, 64):
        sys.exit("the prompt-attention kernel does not build here (see the log): nothing to compare")
    print(
        f"# {model_dir.name}, {args.threads} threads, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    if "a" not in args.skip:
        attention_table(args)
    # no prefix caching: (a)'s passes repeat one prompt per length (bench/engine.py's), and (b)'s
    # random prompts share no prefix
    engine = LLMEngine(str(model_dir), load_progress=False, enable_prefix_caching=False)
    if "a" not in args.skip:
        prompt_pass_table(engine, args)
    if "b" not in args.skip:
        compare_c8(engine, SIDES, lambda side: use_prompt_kernel(engine, side == "kernel"), args)
        use_prompt_kernel(engine, True)


if __name__ == "__main__":
    main()
