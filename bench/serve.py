"""Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang), like
``vllm bench serve``: a compatibility entry. The load generator is the product's own,
``deploy/ops/loadgen/`` (``pdserve bench`` runs it); this keeps ``python bench/serve.py`` and
``from bench.serve import ...`` working.

    python bench/serve.py --dataset random --num-prompts 200 --request-rate 8
    python bench/serve.py --dataset shared-prefix --gsp-num-groups 8 --max-concurrency 16
    python bench/serve.py --dataset multi-turn --mt-turns 4 --result-json mt.json

From Python: ``result = await run_benchmark(BenchConfig(...)); result.summary.cache_hit_rate``.
The run is bounded: a fixed number of requests, each with a total timeout; failed requests are
counted (429/503 separately as refused) and never stop the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.ops.loadgen import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    DATASETS,
    REFUSED_STATUSES,
    SLO_NAMES,
    BenchConfig,
    BenchmarkError,
    BenchmarkResult,
    BenchmarkSummary,
    Conversation,
    LatencyStats,
    Prompt,
    RequestResult,
    TurnStats,
    Workload,
    WorkloadSpec,
    build_parser,
    build_workload,
    config_from_args,
    fetch_model,
    format_result,
    main,
    run_benchmark,
    send_request,
    summarize,
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
    "RequestResult",
    "TurnStats",
    "Workload",
    "WorkloadSpec",
    "build_parser",
    "build_workload",
    "config_from_args",
    "fetch_model",
    "format_result",
    "main",
    "run_benchmark",
    "send_request",
    "summarize",
]

if __name__ == "__main__":
    sys.exit(main())
