"""KV cache quality on real weights: what int8 / fp8 KV cost in greedy agreement and perplexity,
and what their scales cost in memory, measured against the full-precision cache in one run.

    python bench/quality.py                       # SmolLM2-135M-Instruct, CPU fp32
    python bench/quality.py --model DIR --device cuda --dtype bfloat16

(a) Greedy agreement: ``--prompts`` chat prompts (``bench/data/chat_prompts.txt``, ChatML through
    the model's chat template) x ``--max-tokens`` greedy tokens with EOS ignored, per KV dtype
    against ``auto`` (the model's dtype): the share of prompts whose tokens are all identical,
    and the share of tokens generated before each prompt's first divergence.
(b) Perplexity of ``bench/data/heldout.txt`` (self-written English prose, not in any training
    set) in windows of ``--window`` tokens, computed by the engine from its own prompt logprobs
    (``SamplingParams(prompt_logprobs=0)``), with transformers' perplexity of the same windows
    as the reference. Prompts are prefilled in ``--chunk``-token chunks: every chunk after a
    window's first attends to the cache (and so to its quantization); a fresh chunk attends to
    its own unquantized K/V.
(c) Memory: bytes per token of each KV dtype (scale rows included), vs a bf16 cache and vs the
    previous int8/fp8 layout (one scale per block per head, in the same extra row).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine import LLMEngine, SamplingParams  # noqa: E402
from workers.layers.kv_cache import bytes_per_block, scale_granularity  # noqa: E402
from workers.models.config import ModelConfig  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
KINDS = ("auto", "int8", "fp8")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    lines = [line.strip() for line in (DATA / "chat_prompts.txt").read_text().splitlines() if line.strip()]
    if n > len(lines):
        raise SystemExit(f"--prompts {n}: {DATA / 'chat_prompts.txt'} has {len(lines)}")
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": line}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for line in lines[:n]
    ]


def heldout_windows(tokenizer, window: int, path: Path = DATA / "heldout.txt") -> list[list[int]]:
    ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    return [o.token_ids for o in engine.generate(prompts, params)]


def agreement(ref: list[list[int]], out: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(share of prompts identical, share of tokens before each prompt's first divergence)."""
    same = sum(a == b for a, b in zip(ref, out))
    before = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), max_tokens) for a, b in zip(ref, out))
    return same / len(ref), before / (len(ref) * max_tokens)


def engine_nll(engine: LLMEngine, windows: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of every window token after the first, and their count,
    from the engine's prompt logprobs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    total, count = 0.0, 0
    for out in engine.generate(windows, params):
        scored = out.prompt_logprobs[1:]
        total -= sum(entry.logprob for entry in scored)
        count += len(scored)
    return total, count


@torch.inference_mode()
def transformers_nll(model_dir: str, windows: list[list[int]], device: str, dtype: torch.dtype) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    total, count = 0.0, 0
    for window in windows:
        ids = torch.tensor([window], device=device)
        log_probs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        total -= log_probs.gather(1, ids[0, 1:, None]).sum().item()
        count += len(window) - 1
    return total, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="model dtype (default: fp32 on CPU, the checkpoint's on CUDA)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    parser.add_argument("--chunk", type=int, default=16, help="prefill chunk for the perplexity run (tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from workers.models.source import resolve_model

    model_dir = str(resolve_model(args.model))
    config = ModelConfig.from_dir(model_dir)

    def engine(kind: str, **kwargs) -> LLMEngine:
        return LLMEngine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=kind,
            block_size=args.block_size,
            num_kv_blocks=4096,
            load_progress=False,
            **kwargs,
        )

    rows: dict[str, dict] = {}
    ref_tokens = None
    start = time.perf_counter()
    for kind in KINDS:
        eng = engine(kind)
        prompts = chat_prompts(eng.tokenizer, args.prompts)
        windows = heldout_windows(eng.tokenizer, args.window)
        tokens = greedy(eng, prompts, args.max_tokens)
        ref_tokens = ref_tokens or tokens
        same, before = agreement(ref_tokens, tokens, args.max_tokens)
        compute_dtype = eng.dtype
        del eng
        nll, count = engine_nll(engine(kind, max_num_batched_tokens=args.chunk), windows)
        per_block = bytes_per_block(config, args.block_size, kind, compute_dtype)
        rows[kind] = {
            "same": same,
            "before": before,
            "ppl": math.exp(nll / count),
            "count": count,
            "per_token": per_block / args.block_size,
            "compute_dtype": compute_dtype,
        }
    auto_dtype = rows["auto"]["compute_dtype"]
    hf_nll, hf_count = transformers_nll(model_dir, windows, args.device, auto_dtype)
    elapsed = time.perf_counter() - start

    bf16 = bytes_per_block(config, args.block_size, "auto", torch.bfloat16) / args.block_size
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}, model dtype "
        f"{str(auto_dtype).removeprefix('torch.')}; {elapsed:.0f} s"
    )
    print(
        f"model: {model_dir} ({config.num_layers} layers x {config.num_kv_heads} KV heads x head_dim "
        f"{config.head_dim}); block size {args.block_size}"
    )
    print(
        f"(a) {args.prompts} chat prompts x {args.max_tokens} greedy tokens, EOS ignored, vs auto; "
        f"(b) {len(windows)} windows x {args.window} tokens of bench/data/heldout.txt "
        f"({hf_count} scored), prefill chunks of {args.chunk}"
    )
    print(f"int8/fp8 scales: {scale_granularity(args.block_size, config.head_dim)}\n")
    header = (
        f"{'kv cache':<14}{'bytes/token':>12}{'vs bf16':>9}{'vs old int8':>12}{'prompts identical':>19}"
        f"{'tokens before 1st diff':>24}{'perplexity':>12}{'vs auto':>10}{'vs transformers':>17}"
    )
    print(header)
    hf_ppl = math.exp(hf_nll / hf_count)
    for kind, r in rows.items():
        name = kind if kind != "auto" else f"auto ({str(auto_dtype).removeprefix('torch.')})"
        old = f"{1.0:>12.2f}" if kind != "auto" else f"{'-':>12}"  # the scale row is the same size as before
        agree = f"{r['same']:>18.1%} {r['before']:>23.1%}" if kind != "auto" else f"{'(reference)':>19}{'':>24}"
        print(
            f"{name:<14}{r['per_token']:>12,.0f}{r['per_token'] / bf16:>9.3f}{old}{agree}"
            f"{r['ppl']:>12.4f}{r['ppl'] / rows['auto']['ppl'] - 1:>+10.3%}{r['ppl'] / hf_ppl - 1:>+17.4%}"
        )
    print(
        f"{'transformers':<14}{'':>12}{'':>9}{'':>12}{'':>19}{'':>24}{hf_ppl:>12.4f}"
        f"{hf_ppl / rows['auto']['ppl'] - 1:>+10.3%}{'(reference)':>17}"
    )


if __name__ == "__main__":
    main()
