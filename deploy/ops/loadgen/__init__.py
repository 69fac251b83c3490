"""The serving load generator behind ``pdserve bench``: a benchmark client for any OpenAI-compatible
server (pdserve, vLLM, SGLang), like ``vllm bench serve``: streams requests, measures TTFT / TPOT /
ITL / end-to-end latency, prints vLLM's result block, plus the prompt-cache hit rate the server
reports in ``usage``.

    pdserve bench --dataset random --num-prompts 200 --request-rate 8
    pdserve bench --dataset shared-prefix --gsp-num-groups 8 --max-concurrency 16
    pdserve bench --dataset multi-turn --mt-turns 4 --result-json mt.json

From Python: ``result = await run_benchmark(BenchConfig(...)); result.summary.cache_hit_rate``.
The run is bounded: a fixed number of requests, each with a total timeout; failed requests are
counted (429/503 separately as refused) and never stop the run.

    workloads.py   the synthetic workloads: random, shared-prefix, multi-turn
    config.py      BenchConfig: server, endpoint, arrival rate, concurrency, SLOs
    results.py     each request's timings, the summary, vLLM's result block
    client.py      streaming one request, sending a workload (run_benchmark)
    cli.py         the command line (``pdserve bench``, ``python bench/serve.py``)
"""

from deploy.ops.loadgen.cli import build_parser, config_from_args, main
from deploy.ops.loadgen.client import fetch_model, run_benchmark, send_request
from deploy.ops.loadgen.config import CHAT, COMPLETIONS, REFUSED_STATUSES, SLO_NAMES, BenchConfig, BenchmarkError
from deploy.ops.loadgen.results import (
    BenchmarkResult,
    BenchmarkSummary,
    LatencyStats,
    RequestResult,
    TurnStats,
    format_result,
    summarize,
)
from deploy.ops.loadgen.workloads import (
    DATASETS,
    Conversation,
    Prompt,
    PromptMaker,
    Workload,
    WorkloadSpec,
    build_workload,
    ideal_prefix_hit_rate,
)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DATASETS",
    "REFUSED_STATUSES",
    "SLO_NAMES",
    "BenchConfig",
    "BenchmarkError",
    "BenchmarkResult",
    "BenchmarkSummary",
    "Conversation",
    "LatencyStats",
    "Prompt",
    "PromptMaker",
    "RequestResult",
    "TurnStats",
    "Workload",
    "WorkloadSpec",
    "build_parser",
    "build_workload",
    "config_from_args",
    "fetch_model",
    "format_result",
    "ideal_prefix_hit_rate",
    "main",
    "run_benchmark",
    "send_request",
    "summarize",
]
