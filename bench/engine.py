"""Engine benchmark: (a) paged KV cache vs recomputing the sequence each step, (b) engine
(eager, and compiled with --compile) vs transformers ``generate`` at several batch sizes,
(c) the decode step eager vs compiled, interleaved step by step, with where its time goes
(torch.profiler, self CPU time by kind of op), (d) the prompt pass (prefill) of a batch of
prompts, interleaved pass by pass, all measured side by side in one run.

    python bench/engine.py                      # SmolLM2-135M-Instruct (30 x 576), CPU
    python bench/engine.py --compile            # adds the compiled engine to (b) and (c)
    python bench/engine.py --unpacked           # adds an eager engine on plain F.linear weights
    python bench/engine.py --onednn             # adds an eager engine whose decodes stay on oneDNN
                                                # (plain_linear_rows 0: no panel kernel)
    python bench/engine.py --fp32-panels        # adds an eager engine whose panel kernel reads fp32
                                                # panels (coded_weights False: no one-byte codes)
    python bench/engine.py --sdpa               # adds an eager engine whose decodes gather (sdpa)
    python bench/engine.py --onednn-prompts     # adds an eager engine whose wide batches stay on
                                                # oneDNN (amx_linears False: no AMX tiles)
    python bench/engine.py --model tiny         # the generated ~100M random llama (12 x 768)
    python bench/engine.py --device cuda --dtype bfloat16

The model is SmolLM2-135M-Instruct (pulled once) unless --model is given. Every figure is
printed with its baseline from the same run, and as a ratio; the header gives the load average,
which on a shared machine says how much to trust them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import MODEL_HELP, bench_model_dir  # noqa: E402
from workers.engine import LLMEngine, SamplingParams  # noqa: E402


def bench_model(path: Path) -> Path:
    from workers.models.tiny import make_tiny_model

    if not (path / "config.json").is_file():
        make_tiny_model(
            path,
            arch="llama",
            num_layers=12,
            hidden_size=768,
            num_heads=12,
            num_kv_heads=12,
            intermediate_size=2048,
            vocab_size=32000,
            max_position_embeddings=4096,
            seed=0,
        )
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_paged(engine: LLMEngine, context: int, steps: int) -> float:
    """Decode tokens/s for one sequence after a prefill of ``context`` tokens."""
    prompt = [random.Random(context).randrange(100, 30000) for _ in range(context)]
    engine.add_request("paged", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token (not timed)
    sync(engine.device)
    start = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        n += len(engine.step())
    sync(engine.device)
    return n / (time.perf_counter() - start)


@torch.inference_mode()
def decode_recompute(engine: LLMEngine, context: int, steps: int) -> float:
    """Decode tokens/s when every step recomputes the whole sequence (no KV cache)."""
    tokens = [random.Random(context).randrange(100, 30000) for _ in range(context)]
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        logits = engine.runner.forward_without_cache(tokens)
        tokens.append(int(logits[0].argmax()))
    sync(engine.device)
    return steps / (time.perf_counter() - start)


def engine_throughput(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(engine.device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_throughput(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


def best_of(fn, repeats: int) -> float:
    return max(fn() for _ in range(repeats))


# Kinds of op in a profile, by the first pattern its name contains (self CPU time).
OP_KINDS = (
    ("matmul", ("mm", "linear", "mkl", "mkldnn", "matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "paged_attention")),
    ("kv gather/write", ("index", "gather", "scatter")),
    ("fused (compiled)", ("cpp_fused", "triton_", "compiled")),
    ("sampling", ("argmax", "topk", "softmax", "multinomial", "sort")),
)


def op_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in OP_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other ops"


def start_decodes(engine: LLMEngine, batch: int, context: int, tag: str) -> None:
    """``batch`` sequences of ``context`` prompt tokens, prefilled, decoding from here on."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True, detokenize=False)
    for i in range(batch):
        top = min(30000, engine.model_config.vocab_size)
        engine.add_request(f"{tag}-{batch}-{i}", [rng.randrange(100, top) for _ in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine._requests.values()):
        engine.step()
    engine.step()


def stop_decodes(engine: LLMEngine) -> None:
    for request_id in list(engine._requests):
        engine.abort(request_id)


def profile_steps(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Per decode step: ms of self CPU time by kind of op, and the wall time outside them."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        kind = op_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total / 1e3 / steps
    kinds["python + host (rest of wall)"] = max(0.0, wall - sum(kinds.values()))
    kinds["wall"] = wall
    return kinds


def print_interleaved_header(names: list[str], width: int) -> None:
    """(c) and (d)'s header: each engine's min and median, then each one's ratio to the first's."""
    print(
        f"{'batch':>6} "
        + " ".join(f"{n + ' min':>{width}} {n + ' med':>{width}}" for n in names)
        + "".join(f" {names[0] + '/' + n + ' (min)':>{width + 8}}" for n in names[1:])
        + f" {'load':>6}"
    )


def print_interleaved_row(batch: int, times: dict[str, list[float]], width: int) -> dict:
    """Print one batch's row of (c) or (d) from each engine's seconds; returns its figures (ms)."""
    names = list(times)
    row = {n: {"min_ms": min(t) * 1e3, "median_ms": sorted(t)[len(t) // 2] * 1e3} for n, t in times.items()}
    base = row[names[0]]["min_ms"]
    line = f"{batch:>6} " + " ".join(f"{row[n]['min_ms']:>{width}.1f} {row[n]['median_ms']:>{width}.1f}" for n in names)
    line += "".join(f" {base / row[n]['min_ms']:>{width + 7}.2f}x" for n in names[1:])
    print(line + f" {os.getloadavg()[0]:>6.2f}")
    return row


def decode_step_table(
    engines: dict[str, LLMEngine], batches: list[int], context: int, steps: int, profile: bool
) -> dict:
    """Decode step time per engine, the engines' steps interleaved (one each, in turn), and
    the ratio of each to the first (the eager baseline)."""
    names = list(engines)
    results: dict = {}
    print(f"\n(c) decode step, context {context}, {steps} steps each, interleaved; min and median ms")
    print_interleaved_header(names, 14)
    for batch in batches:
        for name, engine in engines.items():
            start_decodes(engine, batch, context, name)
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(steps):
            for name, engine in engines.items():
                t = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t)
        row = print_interleaved_row(batch, times, 14)
        if profile:
            for name, engine in engines.items():
                row[name]["profile_ms"] = profile_steps(engine, max(2, steps // 4))
        results[f"decode_step_b{batch}"] = row
        for engine in engines.values():
            stop_decodes(engine)
    if profile:
        print("\n    where a decode step's time goes (ms per step; ops: their self time on the engine thread)")
        for key, row in results.items():
            for name in names:
                prof = row[name]["profile_ms"]
                parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(prof.items(), key=lambda kv: -kv[1]) if k != "wall")
                print(f"    {key.removeprefix('decode_step_'):>4} {name:>9}: wall {prof['wall']:.1f}; {parts}")
    return results


def prompt_pass(engine: LLMEngine, batch: int, length: int, tag: str) -> float:
    """Seconds for the steps that compute ``batch`` fresh prompts of ``length`` tokens and their
    first tokens (one step when the batch fits ``max_num_batched_tokens``)."""
    rng = random.Random(batch * 7919 + length)
    top = min(30000, engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"{tag}-p{batch}-{i}", [rng.randrange(100, top) for _ in range(length)], params)
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(engine.device)
    return time.perf_counter() - start


def prompt_pass_table(engines: dict[str, LLMEngine], batches: list[int], length: int, rounds: int) -> dict:
    """The prompt pass per engine, the engines' passes interleaved (one each, in turn, after one
    untimed warm-up each), and the ratio of each to the first (the baseline)."""
    names = list(engines)
    results: dict = {}
    print(
        f"\n(d) prompt pass: a batch of fresh {length}-token prompts to their first tokens, {rounds} passes each, "
        "interleaved; min and median ms"
    )
    print_interleaved_header(names, 16)
    for batch in batches:
        for name, engine in engines.items():
            prompt_pass(engine, batch, length, f"{name}-warm")
        times: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(rounds):
            for name, engine in engines.items():
                times[name].append(prompt_pass(engine, batch, length, f"{name}-{round_}"))
        results[f"prompt_pass_b{batch}x{length}"] = print_interleaved_row(batch, times, 16)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--recompute-steps", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each figure")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also build a compiled engine (enforce_eager=False) and compare it in (b) and (c)",
    )
    ap.add_argument(
        "--unpacked",
        action="store_true",
        help="also build an eager engine without prepacked weights (prepack_weights=False, F.linear) "
        "and compare it in (b) and (c), where it is the baseline",
    )
    ap.add_argument(
        "--onednn",
        action="store_true",
        help="also build an eager engine whose small batches stay on oneDNN (plain_linear_rows=0: no "
        "panel kernel, workers/backends/cpu/panels.py) and compare it in (b) and (c), where it is the baseline",
    )
    ap.add_argument(
        "--fp32-panels",
        action="store_true",
        help="also build an eager engine whose panel kernel reads fp32 panels for every weight "
        "(coded_weights=False) and compare it in (b) and (c), where it is the baseline",
    )
    ap.add_argument(
        "--onednn-prompts",
        action="store_true",
        help="also build an eager engine whose batches wider than the panel kernel's stay on oneDNN "
        "(amx_linears=False: no AMX tiles, workers/backends/cpu/amx.py) and compare it in (b), (c) "
        "and (d), where it is the baseline",
    )
    ap.add_argument(
        "--sdpa",
        action="store_true",
        help="also build an eager engine with attention_backend sdpa (decodes gather their blocks) "
        "and compare it in (b) and (c), where it is the baseline",
    )
    ap.add_argument(
        "--compile-batches",
        type=int,
        nargs="+",
        default=None,
        help="the compiled engine's decode buckets (default: powers of two up to the largest batch); "
        "larger batches run eager",
    )
    ap.add_argument("--step-context", type=int, default=256, help="(c): prompt tokens per decoding sequence")
    ap.add_argument("--step-batches", type=int, nargs="+", default=None, help="(c): default --batches")
    ap.add_argument("--steps", type=int, default=12, help="(c): timed decode steps per engine and batch")
    ap.add_argument("--profile", action="store_true", help="(c): add the profile breakdown")
    ap.add_argument("--prompt-batches", type=int, nargs="+", default=[1, 8], help="(d): prompts per pass")
    ap.add_argument("--prompt-step-len", type=int, default=256, help="(d): tokens per prompt")
    ap.add_argument("--prompt-rounds", type=int, default=5, help="(d): timed passes per engine and batch")
    ap.add_argument("--skip", nargs="*", default=[], choices=("a", "b", "c", "d"), help="sections to leave out")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model_dir = bench_model_dir(args.model, bench_model, Path(".cache/bench-llama-100m"))
    step_batches = args.step_batches or args.batches
    engine_kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=None,
        kv_cache_memory_gib=2.0,
        max_num_seqs=max(args.batches + step_batches + args.prompt_batches),
        max_num_batched_tokens=max(2048, max(args.prompt_batches) * args.prompt_step_len),
        enable_prefix_caching=False,
        load_progress=False,
    )
    engine = LLMEngine(str(model_dir), **engine_kwargs)
    engines = {"eager": engine}
    if args.sdpa:  # first: (c) gives every engine's step as a ratio to the first's
        engines = {"sdpa": LLMEngine(str(model_dir), attention_backend="sdpa", **engine_kwargs), **engines}
    if args.fp32_panels:
        engines = {"fp32-panels": LLMEngine(str(model_dir), coded_weights=False, **engine_kwargs), **engines}
    if args.onednn:
        engines = {"onednn": LLMEngine(str(model_dir), plain_linear_rows=0, **engine_kwargs), **engines}
    if args.onednn_prompts:
        engines = {"onednn-wide": LLMEngine(str(model_dir), amx_linears=False, **engine_kwargs), **engines}
    if args.unpacked:
        engines = {"unpacked": LLMEngine(str(model_dir), prepack_weights=False, **engine_kwargs), **engines}
    cfg = engine.model_config
    print(f"# bench/engine.py  {' '.join(sys.argv[1:]) or '(defaults)'}")
    print(
        f"# model {model_dir} ({cfg.num_params / 1e6:.0f}M params, {cfg.num_layers}x{cfg.hidden_size}), "
        f"device {device} {engine.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"eager attention {engine.runner.attention_backend}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    results: dict = {"model": str(model_dir), "device": str(device), "dtype": str(engine.dtype)}
    if args.compile:
        started = time.perf_counter()
        engines["compiled"] = LLMEngine(
            str(model_dir),
            enforce_eager=False,
            compile_batch_sizes=tuple(args.compile_batches or ()) or None,
            **engine_kwargs,
        )
        buckets = engines["compiled"].runner.compiled.buckets
        results["compile_s"] = time.perf_counter() - started
        print(
            f"# compiled engine: decode buckets {','.join(map(str, buckets))}, built and compiled in "
            f"{results['compile_s']:.0f} s (load average now {os.getloadavg()[0]:.2f})"
        )

    if "a" not in args.skip:
        section_a(engine, args, results)
    if "b" not in args.skip:
        section_b(engines, model_dir, device, args, results)
    if "c" not in args.skip:
        results.update(decode_step_table(engines, step_batches, args.step_context, args.steps, args.profile))
    if "d" not in args.skip:
        results.update(prompt_pass_table(engines, args.prompt_batches, args.prompt_step_len, args.prompt_rounds))
    engine.block_manager.check_idle()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def section_a(engine: LLMEngine, args, results: dict) -> None:
    print("\n(a) decode tokens/s, one sequence: paged KV cache vs recompute-every-step")
    print(f"{'context':>8} {'paged tok/s':>12} {'recompute tok/s':>16} {'speedup':>8}")
    for ctx in args.contexts:
        paged = best_of(lambda ctx=ctx: decode_paged(engine, ctx, args.decode_steps), args.repeats)
        recompute = best_of(lambda ctx=ctx: decode_recompute(engine, ctx, args.recompute_steps), args.repeats)
        results[f"decode_ctx{ctx}"] = {"paged": paged, "recompute": recompute, "speedup": paged / recompute}
        print(f"{ctx:>8} {paged:>12.1f} {recompute:>16.2f} {paged / recompute:>7.1f}x")


def section_b(engines: dict[str, LLMEngine], model_dir, device, args, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=engines["eager"].dtype).to(device).eval()
    print(f"\n(b) generation throughput (output tok/s), prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy")
    print(
        f"{'batch':>6} "
        + " ".join(f"{'pdserve ' + n:>17}" for n in engines)
        + f" {'transformers':>13} "
        + " ".join(f"{n + '/hf':>12}" for n in engines)
        + f" {'load':>6}"
    )
    rng = random.Random(0)
    for batch in args.batches:
        prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(batch)]
        ours = {
            n: best_of(lambda e=e, prompts=prompts: engine_throughput(e, prompts, args.new_tokens), args.repeats)
            for n, e in engines.items()
        }
        theirs = best_of(lambda prompts=prompts: hf_throughput(hf, prompts, args.new_tokens, device), args.repeats)
        results[f"throughput_b{batch}"] = {
            **{f"pdserve_{n}": v for n, v in ours.items()},
            "transformers": theirs,
            **{f"ratio_{n}": v / theirs for n, v in ours.items()},
        }
        print(
            f"{batch:>6} "
            + " ".join(f"{v:>17.1f}" for v in ours.values())
            + f" {theirs:>13.1f} "
            + " ".join(f"{v / theirs:>11.2f}x" for v in ours.values())
            + f" {os.getloadavg()[0]:>6.2f}"
        )


if __name__ == "__main__":
    main()
