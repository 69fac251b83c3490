"""A run's results: each request's timings, the summary over them, and vLLM's result block."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from deploy.ops.loadgen.config import BenchConfig
from deploy.ops.loadgen.workloads import Workload


@dataclass
class RequestResult:
    """One request's outcome, filled in as its stream arrives. Times are seconds."""

    success: bool = False
    refused: bool = False  # HTTP 429/503: the server shed load
    status: int | None = None
    error: str = ""
    start_s: float = 0.0  # since the benchmark started
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    expected_prompt_tokens: int = 0  # from the workload (approximate without a tokenizer)
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    generated_text: str = ""
    conversation: int | None = None
    turn: int | None = None  # 1-based

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.expected_prompt_tokens


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    max_ms: float
    percentiles_ms: dict[str, float]  # "p99" -> ms

    @classmethod
    def of(cls, values_s: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        ms = np.asarray(values_s, dtype=float) * 1000.0
        if ms.size == 0:
            return cls(0.0, 0.0, 0.0, 0.0, {_pkey(p): 0.0 for p in percentiles})
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            float(ms.max()),
            {_pkey(p): float(np.percentile(ms, p)) for p in percentiles},
        )


def _pkey(p: float) -> str:
    return f"p{p:g}"


@dataclass(frozen=True)
class TurnStats:
    turn: int
    completed: int
    mean_ttft_ms: float
    mean_prompt_tokens: float
    mean_cached_tokens: float | None


@dataclass(frozen=True)
class BenchmarkSummary:
    completed: int
    failed: int  # includes the refused
    refused: int
    skipped: int  # multi-turn turns not sent because an earlier turn failed
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None without SLOs
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    cached_tokens: int | None  # None: the server reported no cached_tokens
    cache_hit_rate: float | None  # cached / prompt tokens, over the requests that reported both
    ideal_cache_hit_rate: float | None  # shared-prefix only
    per_turn: tuple[TurnStats, ...]  # multi-turn only


@dataclass(frozen=True)
class BenchmarkResult:
    config: BenchConfig
    model: str
    summary: BenchmarkSummary
    requests: tuple[RequestResult, ...]

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["request_rate"] = _finite_or_str(self.config.request_rate)
        config["api_key"] = "<redacted>" if self.config.api_key else None
        reqs = self.requests
        return {
            "config": config,
            "model": self.model,
            "endpoint": self.config.resolved_endpoint,
            "summary": asdict(self.summary),
            "requests": {
                "success": [r.success for r in reqs],
                "refused": [r.refused for r in reqs],
                "status": [r.status for r in reqs],
                "errors": [r.error for r in reqs],
                "start_times": [r.start_s for r in reqs],
                "ttfts": [r.ttft_s for r in reqs],
                "tpots": [r.tpot_s for r in reqs],
                "itls": [r.itl_s for r in reqs],
                "e2els": [r.e2el_s for r in reqs],
                "input_lens": [r.input_tokens for r in reqs],
                "output_lens": [r.output_tokens for r in reqs],
                "cached_tokens": [r.cached_tokens for r in reqs],
                "conversation": [r.conversation for r in reqs],
                "turn": [r.turn for r in reqs],
                "generated_texts": [r.generated_text for r in reqs],
            },
        }


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


# --- summary and report ------------------------------------------------------------------------


def summarize(
    requests: tuple[RequestResult, ...], duration_s: float, config: BenchConfig, workload: Workload, skipped: int = 0
) -> BenchmarkSummary:
    ok = [r for r in requests if r.success]
    percentiles = tuple(sorted(set(config.percentiles) | {95.0, 99.0}))
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reported = [(r.cached_tokens, r.prompt_tokens) for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(c for c, _ in reported) if reported else None
    hit_rate = cached / sum(p for _, p in reported) if cached is not None else None
    goodput = None
    if config.goodput_slos_ms:
        good = sum(1 for r in ok if _meets_slos(r, config.goodput_slos_ms))
        goodput = good / duration_s
    return BenchmarkSummary(
        completed=len(ok),
        failed=len(requests) - len(ok),
        refused=sum(r.refused for r in requests),
        skipped=skipped,
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        request_goodput=goodput,
        ttft=LatencyStats.of([r.ttft_s for r in ok], percentiles),
        tpot=LatencyStats.of([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s], percentiles),
        e2el=LatencyStats.of([r.e2el_s for r in ok], percentiles),
        cached_tokens=cached,
        cache_hit_rate=hit_rate,
        ideal_cache_hit_rate=workload.ideal_cache_hit_rate,
        per_turn=_per_turn(ok),
    )


def _meets_slos(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    measured_ms = {"ttft": r.ttft_s * 1000, "tpot": (r.tpot_s or 0.0) * 1000, "e2el": r.e2el_s * 1000}
    return all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def _per_turn(ok: list[RequestResult]) -> tuple[TurnStats, ...]:
    turns = sorted({r.turn for r in ok if r.turn is not None})
    stats = []
    for turn in turns:
        rs = [r for r in ok if r.turn == turn]
        cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        stats.append(
            TurnStats(
                turn,
                len(rs),
                float(np.mean([r.ttft_s for r in rs])) * 1000,
                float(np.mean([r.input_tokens for r in rs])),
                float(np.mean(cached)) if cached else None,
            )
        )
    return tuple(stats)


def format_result(result: BenchmarkResult) -> str:
    """vLLM's ``bench serve`` block, plus refusals, the prompt cache and per-turn lines."""
    s, config = result.summary, result.config
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    row("Refused requests (429/503):", s.refused)
    if s.skipped:
        row("Skipped turns (earlier turn failed):", s.skipped)
    row("Maximum request concurrency:", config.max_concurrency or "unlimited")
    row("Traffic request rate (req/s):", _finite_or_str(config.request_rate))
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens)
    row("Total generated tokens:", s.total_output_tokens)
    row("Request throughput (req/s):", s.request_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total Token throughput (tok/s):", s.total_token_throughput)
    if s.request_goodput is not None:
        row("Request goodput (req/s):", s.request_goodput)
    shown = [p for p in sorted(set(config.percentiles) | {99.0}) if p != 50]
    sections = (
        ("ttft", "TTFT", "Time to First Token", s.ttft),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)", s.tpot),
        ("itl", "ITL", "Inter-token Latency", s.itl),
        ("e2el", "E2EL", "End-to-end Latency", s.e2el),
    )
    for key, short, title, stats in sections:
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        for p in sorted(set(shown) | ({95.0} if key == "itl" else set())):
            row(f"P{p:g} {short} (ms):", stats.percentiles_ms[_pkey(p)])
        if key == "itl":
            row("Max ITL (ms):", stats.max_ms)
    lines.append(f"{'Prompt Cache':-^50}")
    if s.cached_tokens is None or s.cache_hit_rate is None:  # both or neither (summarize)
        row("Cached prompt tokens:", "n/a (server reported no cached_tokens)")
    else:
        row("Cached prompt tokens:", s.cached_tokens)
        row("Measured cache hit rate (%):", 100.0 * s.cache_hit_rate)
    if s.ideal_cache_hit_rate is not None:
        row("Ideal cache hit rate (%):", 100.0 * s.ideal_cache_hit_rate)
    if s.per_turn:
        lines.append(f"{'Multi-turn (per turn)':-^50}")
        for t in s.per_turn:
            row(f"Turn {t.turn} mean TTFT (ms):", t.mean_ttft_ms)
            cached = "n/a" if t.mean_cached_tokens is None else f"{t.mean_cached_tokens:.1f}"
            row(f"Turn {t.turn} mean cached / prompt tokens:", f"{cached} / {t.mean_prompt_tokens:.1f}")
    lines.append("=" * 50)
    return "\n".join(lines)
