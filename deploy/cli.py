"""The `pdserve` command line.

Each subcommand is a pair: `_add_<name>_parser(subparsers)` declares its arguments and sets
`handler`, and `_run_<name>(args) -> int` does the work. Heavy imports (torch, transformers,
ray) stay inside the handlers so `pdserve --help` returns at once.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _add_tiny_model_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random Hugging Face model (weights, config, tokenizer) for tests",
        description="Write a seeded random model directory that transformers loads like a real "
                    "checkpoint. Made offline in seconds; the same seed gives identical files.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=("llama", "mistral", "qwen2", "qwen3"), default="llama")
    parser.add_argument("--layers", type=_positive_int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=_positive_int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=_positive_int, default=4, help="query heads (default 4)")
    parser.add_argument("--kv-heads", type=_positive_int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--head-dim", type=_positive_int, default=None,
                        help="per-head dim (default hidden // heads; qwen3 may differ)")
    parser.add_argument("--intermediate", type=_positive_int, default=None,
                        help="MLP intermediate size (default 2 * hidden)")
    parser.add_argument("--vocab", type=_positive_int, default=1024,
                        help="model vocab size; the tokenizer gets at most this many tokens")
    parser.add_argument("--max-position-embeddings", type=_positive_int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true", help="share embed_tokens and lm_head")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--rope-scaling", choices=("llama3",), default=None,
                        help="add Llama-3.1 style rope scaling with default factors")
    parser.add_argument("--sliding-window", type=_positive_int, default=None,
                        help="sliding attention window (mistral, qwen2, qwen3)")
    parser.add_argument("--max-shard-size", type=_positive_int, default=None, metavar="BYTES",
                        help="split weights into shards of at most this size, with an index file")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.set_defaults(handler=_run_tiny_model)


def _run_tiny_model(args: argparse.Namespace) -> int:
    from workers.models.tiny import (
        Llama3RopeScaling, TinyModelSpec, tokenizer_vocab_size, write_tiny_model,
    )

    try:
        spec = TinyModelSpec(
            arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
            num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
            vocab_size=args.vocab, max_position_embeddings=args.max_position_embeddings,
            seed=args.seed, tie_word_embeddings=args.tie_embeddings, rope_theta=args.rope_theta,
            rope_scaling=Llama3RopeScaling() if args.rope_scaling == "llama3" else None,
            sliding_window=args.sliding_window, max_shard_size=args.max_shard_size, dtype=args.dtype,
        )
    except ValueError as exc:
        print(f"pdserve tiny-model: {exc}", file=sys.stderr)
        return 2
    out = write_tiny_model(spec, args.out_dir)
    print(out)
    print(
        f"{spec.arch}: {spec.num_parameters:,} params ({spec.num_parameters / 1e6:.2f}M), "
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, heads {spec.num_heads}/"
        f"{spec.num_kv_heads} kv, head_dim {spec.resolved_head_dim}, vocab {spec.vocab_size} "
        f"(tokenizer {tokenizer_vocab_size(spec.vocab_size)}), {spec.dtype}, seed {spec.seed}"
    )
    return 0


def default_model_dir() -> str:
    """The embedded default: a tiny llama written once under the user's cache directory."""
    import os
    from pathlib import Path

    from workers.models.tiny import make_tiny_model

    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    path = root / "models" / "tiny-llama"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="llama", seed=0)
    return str(path)


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate from a model with the engine in this process (no Ray, no Redis)",
        description="Run the engine on a few prompts and print the completions. Without --model "
                    "it uses the embedded default, a generated tiny llama (random weights).",
    )
    parser.add_argument("prompts", nargs="*", default=["Hello, my name is", "The capital of France is"])
    parser.add_argument("--model", default=None, help="Hugging Face model directory")
    parser.add_argument("--max-tokens", type=_positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    parser.add_argument("--block-size", type=_positive_int, default=16)
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from workers.engine import LLMEngine, SamplingParams

    model = args.model or default_model_dir()
    engine = LLMEngine(model, block_size=args.block_size, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s) from {model} on {engine.device}")
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_tiny_model_parser,
    _add_generate_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray Serve.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
