"""Engine benchmark: (a) paged KV cache vs recomputing the sequence each step, (b) engine vs
transformers ``generate`` at several batch sizes, measured side by side in one run.

    python bench/engine.py                      # SmolLM2-135M-Instruct (30 x 576), CPU
    python bench/engine.py --model tiny         # the generated ~100M random llama (12 x 768)
    python bench/engine.py --device cuda --dtype bfloat16

The model is SmolLM2-135M-Instruct (pulled once) unless --model is given. Every figure is printed with its baseline from the same run, and as a ratio.
"""

from __future__ import annotations

import argparse
import json
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
            path, arch="llama", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12,
            intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096, seed=0,
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
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


def best_of(fn, repeats: int) -> float:
    return max(fn() for _ in range(repeats))


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
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model_dir = bench_model_dir(args.model, bench_model, Path(".cache/bench-llama-100m"))
    engine = LLMEngine(
        str(model_dir), device=args.device, dtype=args.dtype, num_kv_blocks=None,
        kv_cache_memory_gib=2.0, max_num_seqs=max(args.batches), enable_prefix_caching=False,
        load_progress=False,
    )
    cfg = engine.model_config
    print(f"# bench/engine.py  {' '.join(sys.argv[1:]) or '(defaults)'}")
    print(
        f"# model {model_dir} ({cfg.num_params / 1e6:.0f}M params, {cfg.num_layers}x{cfg.hidden_size}), "
        f"device {device} {engine.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}"
    )
    results: dict = {"model": str(model_dir), "device": str(device), "dtype": str(engine.dtype)}

    print("\n(a) decode tokens/s, one sequence: paged KV cache vs recompute-every-step")
    print(f"{'context':>8} {'paged tok/s':>12} {'recompute tok/s':>16} {'speedup':>8}")
    for ctx in args.contexts:
        paged = best_of(lambda: decode_paged(engine, ctx, args.decode_steps), args.repeats)
        recompute = best_of(lambda: decode_recompute(engine, ctx, args.recompute_steps), args.repeats)
        results[f"decode_ctx{ctx}"] = {"paged": paged, "recompute": recompute, "speedup": paged / recompute}
        print(f"{ctx:>8} {paged:>12.1f} {recompute:>16.2f} {paged / recompute:>7.1f}x")

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=engine.dtype).to(device).eval()
    print(f"\n(b) generation throughput (output tok/s), prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy")
    print(f"{'batch':>6} {'pdserve':>10} {'transformers':>13} {'ratio':>7}")
    rng = random.Random(0)
    for batch in args.batches:
        prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(batch)]
        ours = best_of(lambda: engine_throughput(engine, prompts, args.new_tokens), args.repeats)
        theirs = best_of(lambda: hf_throughput(hf, prompts, args.new_tokens, device), args.repeats)
        results[f"throughput_b{batch}"] = {"pdserve": ours, "transformers": theirs, "ratio": ours / theirs}
        print(f"{batch:>6} {ours:>10.1f} {theirs:>13.1f} {ours / theirs:>6.2f}x")
    engine.block_manager.check_idle()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
