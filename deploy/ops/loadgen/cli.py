"""Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang), like
``vllm bench serve``: streams requests, measures TTFT / TPOT / ITL / end-to-end latency, prints
vLLM's result block, plus the prompt-cache hit rate the server reports in ``usage``.

The command line of ``pdserve bench`` (and ``python bench/serve.py``, its script form).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from deploy.ops.loadgen.client import run_benchmark
from deploy.ops.loadgen.config import CHAT, COMPLETIONS, BenchConfig, BenchmarkError
from deploy.ops.loadgen.results import format_result
from deploy.ops.loadgen.workloads import DATASETS, WorkloadSpec, build_workload

DESCRIPTION = (
    "Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang), like\n"
    "``vllm bench serve``: streams requests, measures TTFT / TPOT / ITL / end-to-end latency, prints\n"
    "vLLM's result block, plus the prompt-cache hit rate the server reports in ``usage``."
)

# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = WorkloadSpec()
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--endpoint",
        choices=(COMPLETIONS, CHAT),
        default=None,
        help=f"unset: {CHAT} for multi-turn, else {COMPLETIONS}",
    )
    p.add_argument("--model", default=None, help="unset: the first id of GET /v1/models")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="random dataset only")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--output-len", type=int, default=None, help="overrides every dataset's output length")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS", help="e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--percentiles", default="50,90,95,99")
    p.add_argument("--result-json", default=None, metavar="PATH")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer: exact prompt lengths")
    p.add_argument("--block-size", type=int, default=d.block_size, help="for the ideal cache hit rate")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--extra-body", default=None, metavar="JSON", help='e.g. \'{"cache_salt": "x"}\'')
    for name in (
        "random_input_len",
        "random_output_len",
        "random_range_ratio",
        "gsp_num_groups",
        "gsp_prompts_per_group",
        "gsp_system_prompt_len",
        "gsp_question_len",
        "gsp_output_len",
        "mt_num_conversations",
        "mt_turns",
        "mt_user_len",
        "mt_output_len",
    ):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Raises ValueError with what to change."""
    try:
        percentiles = tuple(float(x) for x in args.percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--percentiles {args.percentiles!r}: give numbers like 50,90,99") from None
    slos: dict[str, float] = {}
    for item in args.goodput or []:
        name, _, ms = item.partition(":")
        try:
            slos[name] = float(ms)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: write SLO:MS, e.g. ttft:500") from None
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError('--extra-body must be a JSON object, e.g. {"cache_salt": "x"}')
    spec_fields = {
        name: getattr(args, name)
        for name in WorkloadSpec.__dataclass_fields__
        if name not in ("dataset", "seed", "num_prompts", "output_len", "tokenizer", "block_size")
    }
    workload = WorkloadSpec(
        dataset=args.dataset,
        seed=args.seed,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        **spec_fields,
    )
    return BenchConfig(
        workload=workload,
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        goodput_slos_ms=slos,
        percentiles=percentiles,
        extra_body=extra,
        timeout_s=args.timeout,
        progress=not args.disable_tqdm,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        workload = build_workload(config.workload)  # loads the tokenizer: outside the event loop
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(config, workload))
    except KeyboardInterrupt:
        print("interrupted: in-flight requests cancelled, no result written", file=sys.stderr)
        return 130
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(format_result(result))
    return 0 if result.summary.completed else 1
