"""Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang), like
``vllm bench serve``: streams requests, measures TTFT / TPOT / ITL / end-to-end latency, prints
vLLM's result block, plus the prompt-cache hit rate the server reports in ``usage``.

    python bench/serve.py --dataset random --num-prompts 200 --request-rate 8
    python bench/serve.py --dataset shared-prefix --gsp-num-groups 8 --max-concurrency 16
    python bench/serve.py --dataset multi-turn --mt-turns 4 --result-json mt.json

From Python: ``result = await run_benchmark(BenchConfig(...)); result.summary.cache_hit_rate``.
The run is bounded: a fixed number of requests, each with a total timeout; failed requests are
counted (429/503 separately as refused) and never stop the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import (  # noqa: E402
    DATASETS,
    Conversation,
    Prompt,
    Workload,
    WorkloadSpec,
    build_workload,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REFUSED_STATUSES = (429, 503)
SLO_NAMES = ("ttft", "tpot", "e2el")


class BenchmarkError(Exception):
    """The benchmark cannot run at all (no model to name, bad server address)."""


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # None: the chat endpoint for multi-turn, completions otherwise
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # Poisson arrivals per second; inf sends everything at once
    max_concurrency: int | None = None  # in-flight requests (conversations, for multi-turn)
    ignore_eos: bool = False
    temperature: float = 0.0
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)  # "ttft"|"tpot"|"e2el" -> ms
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0  # per request, connect to last byte
    progress: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in (None, COMPLETIONS, CHAT):
            raise ValueError(f"endpoint {self.endpoint!r} is unknown: use {COMPLETIONS} or {CHAT}")
        if self.workload.dataset == "multi-turn" and self.endpoint == COMPLETIONS:
            raise ValueError(f"the multi-turn dataset sends message lists: use --endpoint {CHAT}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate {self.request_rate} must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency {self.max_concurrency} must be at least 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout {self.timeout_s} must be positive seconds")
        for name, ms in self.goodput_slos_ms.items():
            if name not in SLO_NAMES or not ms > 0:
                forms = " ".join(f"{n}:MS" for n in SLO_NAMES)
                raise ValueError(f"goodput SLO {name}:{ms} is invalid: use {forms} with positive milliseconds")
        if not self.percentiles or any(not 0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"percentiles {self.percentiles} must lie in (0, 100]")

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint or (CHAT if self.workload.dataset == "multi-turn" else COMPLETIONS)

    @property
    def chat(self) -> bool:
        return self.resolved_endpoint == CHAT

    @property
    def server_root(self) -> str:
        """The base URL without a trailing ``/v1``: endpoints carry their own."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root


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


# --- one request -------------------------------------------------------------------------------


async def send_request(
    client: httpx.AsyncClient, endpoint: str, payload: dict[str, Any], timeout_s: float
) -> RequestResult:
    """POST a streaming request and time its chunks. Never raises except on cancellation."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, endpoint, payload, result, start), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:g}s"
    except Exception as exc:  # a failed request is data, not a reason to stop the run
        result.error = f"{type(exc).__name__}: {exc}"
    result.success = result.success and not result.error
    return result


async def _stream(
    client: httpx.AsyncClient, endpoint: str, payload: dict[str, Any], result: RequestResult, start: float
) -> None:
    chat = endpoint == CHAT
    async with client.stream("POST", endpoint, json=payload) as response:
        result.status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.refused = response.status_code in REFUSED_STATUSES
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            return
        pieces: list[str] = []
        last = start
        completion_tokens = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, event: lines
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                result.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return
            if usage := chunk.get("usage"):
                completion_tokens = usage.get("completion_tokens", completion_tokens)
                result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    result.cached_tokens = int(details["cached_tokens"])
            if piece := _content(chunk, chat):
                now = time.perf_counter()
                if pieces:
                    result.itl_s.append(now - last)
                else:
                    result.ttft_s = now - start
                last = now
                pieces.append(piece)
        result.e2el_s = time.perf_counter() - start
        result.generated_text = "".join(pieces)
        if not pieces:
            result.error = "stream ended without content"
            return
        result.output_tokens = completion_tokens if completion_tokens is not None else len(pieces)
        result.success = True


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _error_message(body: str) -> str:
    try:
        message = json.loads(body)["error"]
        message = message.get("message", message) if isinstance(message, dict) else message
        return str(message)[:300]
    except (ValueError, KeyError, TypeError):
        return body.strip()[:300]


# --- the run -----------------------------------------------------------------------------------


async def fetch_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise BenchmarkError(
            f"could not read a model id from {client.base_url}/v1/models ({type(exc).__name__}: {exc}): pass --model"
        ) from exc


class _Runner:
    """Sends a workload's units (prompts, or whole conversations) and collects their results."""

    def __init__(self, config: BenchConfig, client: httpx.AsyncClient, model: str, total: int) -> None:
        self.config, self.client, self.model = config, client, model
        self.semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.start = time.perf_counter()
        self.skipped = 0
        self.progress = _progress_bar(total) if config.progress else None

    def payload(
        self, output_len: int, prompt: str | None = None, messages: list[dict[str, str]] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.config.temperature,
        }
        if messages is not None:
            body.update(messages=messages, max_completion_tokens=output_len)
        else:
            body.update(prompt=prompt, max_tokens=output_len)
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension; pdserve and SGLang accept it too
        body.update(self.config.extra_body)
        return body

    async def send(self, payload: dict[str, Any], expected_prompt_tokens: int) -> RequestResult:
        start_s = time.perf_counter() - self.start
        config = self.config
        result = await send_request(self.client, config.resolved_endpoint, payload, config.timeout_s)
        result.start_s, result.expected_prompt_tokens = start_s, expected_prompt_tokens
        if self.progress is not None:
            self.progress.update(1)
        return result

    async def run_prompt(self, prompt: Prompt) -> list[RequestResult]:
        if self.config.chat:
            payload = self.payload(prompt.output_len, messages=prompt.chat_messages())
        else:
            payload = self.payload(prompt.output_len, prompt=prompt.completion_prompt())
        async with self.semaphore or contextlib.nullcontext():
            return [await self.send(payload, prompt.prompt_len)]

    async def run_conversation(self, index: int, conversation: Conversation) -> list[RequestResult]:
        """Turns run in order, each resending the history with the replies actually received;
        the semaphore is held for the whole conversation."""
        messages: list[dict[str, str]] = []
        results: list[RequestResult] = []
        async with self.semaphore or contextlib.nullcontext():
            for turn, user_text in enumerate(conversation.user_turns, start=1):
                messages.append({"role": "user", "content": user_text})
                payload = self.payload(conversation.output_len, messages=list(messages))
                result = await self.send(payload, sum(conversation.user_lens[:turn]))
                result.conversation, result.turn = index, turn
                results.append(result)
                if not result.success:  # no reply to continue from
                    self.skipped += len(conversation.user_turns) - turn
                    if self.progress is not None:
                        self.progress.update(len(conversation.user_turns) - turn)
                    break
                messages.append({"role": "assistant", "content": result.generated_text})
        return results


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req")


async def run_benchmark(
    config: BenchConfig, workload: Workload | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> BenchmarkResult:
    """Send the workload (built from ``config.workload`` unless given) and summarize it."""
    workload = workload if workload is not None else build_workload(config.workload)
    units = workload.prompts or workload.conversations
    pool = config.max_concurrency or max(1, len(units))
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # trust_env=False: a proxy from the environment would sit inside every measured latency.
    async with httpx.AsyncClient(
        base_url=config.server_root,
        headers=headers,
        transport=transport,
        trust_env=False,
        timeout=httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
    ) as client:
        model = config.model or await fetch_model(client)
        runner = _Runner(config, client, model, workload.num_requests)
        arrivals = np.random.default_rng(config.workload.seed + 1)
        tasks: list[asyncio.Task] = []
        try:
            for index, unit in enumerate(units):
                if index and math.isfinite(config.request_rate):
                    await asyncio.sleep(arrivals.exponential(1.0 / config.request_rate))
                if isinstance(unit, Conversation):
                    tasks.append(asyncio.create_task(runner.run_conversation(index, unit)))
                else:
                    tasks.append(asyncio.create_task(runner.run_prompt(unit)))
            per_unit = await asyncio.gather(*tasks)
        finally:  # on Ctrl-C / cancellation: no request outlives the run
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if runner.progress is not None:
                runner.progress.close()
        duration = time.perf_counter() - runner.start
    requests = tuple(r for results in per_unit for r in results)
    summary = summarize(requests, duration, config, workload, runner.skipped)
    return BenchmarkResult(config, model, summary, requests)


# --- summary and report ------------------------------------------------------------------------


def summarize(
    requests: tuple[RequestResult, ...], duration_s: float, config: BenchConfig, workload: Workload, skipped: int = 0
) -> BenchmarkSummary:
    ok = [r for r in requests if r.success]
    percentiles = tuple(sorted(set(config.percentiles) | {95.0, 99.0}))
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens for r in reporting) if reporting else None
    hit_rate = cached / sum(r.prompt_tokens for r in reporting) if reporting else None
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
    if s.cached_tokens is None:
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


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = WorkloadSpec()
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description=__doc__.split("\n\n")[0],
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


if __name__ == "__main__":
    sys.exit(main())
