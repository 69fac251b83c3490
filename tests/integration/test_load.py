"""64 concurrent streaming clients against pools with small bounded queues, twice: every request
either completes or is refused with 503/429 + Retry-After before its first byte; none hangs, none
is lost; replica memory stays flat between the rounds and every block is free afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import deploy, wait_idle

pytestmark = pytest.mark.timeout(600)
APP, PREFIX, MODEL = "load", "/load", "llama"
CLIENTS, ROUNDS = 64, 2
REQUEST_TIMEOUT_S, ROUND_TIMEOUT_S = 60.0, 150.0
RSS_GROWTH_LIMIT = 50 << 20  # bytes, or 10 % of the first round's RSS, whichever is larger
WORDS = (
    "river stone light cloud harbor lantern meadow copper signal winter orchard thunder paper "
    "silver garden engine falcon marble canyon velvet"
).split()


@pytest.fixture(scope="module")
def load_app(serve_cluster, tiny_llama):
    from ray import serve

    bounded = {"replicas": 1, "num_cpus": 0.5, "max_ongoing_requests": 8, "max_queued_requests": 16}
    args = {
        "model": tiny_llama,
        "served_model_name": MODEL,
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "prefill": bounded,
        "decode": bounded,
    }
    base = deploy(serve_cluster, APP, PREFIX, args)
    yield base
    serve.delete(APP)


@dataclass
class Outcome:
    status: int | None = None
    retry_after: str | None = None
    done: bool = False  # ended with data: [DONE]
    completion_tokens: int | None = None
    finish_reason: str | None = None
    in_stream_error: dict | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None  # a transport failure or timeout
    body: str = field(default="", repr=False)


def prompts(round_index: int) -> list[tuple[str, int]]:
    """Distinct prompts; every group of eight shares a long prefix (the cache and the index move)."""
    rng = random.Random(1000 + round_index)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(48)) for _ in range(CLIENTS // 8)]
    out = []
    for i in range(CLIENTS):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        prompt = f"{prefixes[i % len(prefixes)]} | round {round_index} client {i}: {tail}"
        out.append((prompt, rng.choice((16, 24, 32))))
    return out


async def stream_one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> Outcome:
    out = Outcome()
    try:
        await asyncio.wait_for(_stream(client, base, prompt, max_tokens, out), REQUEST_TIMEOUT_S)
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _stream(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, out: Outcome) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        out.status = resp.status_code
        out.retry_after = resp.headers.get("retry-after")
        if resp.status_code != 200:
            out.body = (await resp.aread()).decode()
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
            data = line[len("data: ") :]
            if data == "[DONE]":
                out.done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out.in_stream_error = chunk["error"]
            for choice in chunk.get("choices", ()):
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
    out.e2e_s = time.perf_counter() - start


async def run_round(base: str, round_index: int) -> list[tuple[int, Outcome]]:
    limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        work = prompts(round_index)
        results = await asyncio.wait_for(
            asyncio.gather(*(stream_one(client, base, p, n) for p, n in work)), ROUND_TIMEOUT_S
        )
    return [(n, r) for (_, n), r in zip(work, results)]


def replica_rss() -> dict[int, int]:
    """RSS in bytes of every replica process of this app, by pid (Ray titles them
    ``ray::ServeReplica:load:<deployment>``); read from /proc, so Linux only."""
    rss = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if f"ServeReplica:{APP}:" not in title:
                continue
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            rss[int(proc.name)] = int(fields["VmRSS"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            continue  # the process ended while we looked
    return rss


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads replica RSS from /proc")
def test_concurrent_streams_complete_or_are_refused(load_app):
    base = load_app
    assert len(replica_rss()) == 3, replica_rss()  # ingress, prefill, decode
    completed, refused, e2e, ttft = [], [], [], []
    problems, rss_after = [], []
    for round_index in range(ROUNDS):
        outcomes = asyncio.run(run_round(base, round_index))  # wait_for raises if any request hangs
        assert len(outcomes) == CLIENTS
        for max_tokens, out in outcomes:
            if (
                out.status == 200
                and out.done
                and out.in_stream_error is None
                and (out.completion_tokens == max_tokens or out.finish_reason == "stop")
            ):
                completed.append(out)
                e2e.append(out.e2e_s)
                ttft.append(out.ttft_s)
            elif out.status in (429, 503) and out.retry_after and "error" in json.loads(out.body):
                refused.append(out)
            else:
                problems.append(out)
        wait_idle(base)  # free == total on every replica after each round
        rss_after.append(replica_rss())
    assert completed, f"nothing completed: {problems[:3] or refused[:3]}"
    first, second = rss_after
    growth = sum(second.values()) - sum(first.values())
    hung = [out for out in problems if out.error and "Timeout" in out.error]
    refusal_codes = "/".join(map(str, sorted({out.status for out in refused}))) or "none"
    print(
        f"\nload: {ROUNDS} rounds x {CLIENTS} concurrent streams: {len(completed)} completed, {len(refused)} "
        f"refused ({refusal_codes} + Retry-After), {len(problems) - len(hung)} lost, {len(hung)} hung; "
        f"e2e p50 {percentile(e2e, 50) * 1e3:.0f} ms p99 {percentile(e2e, 99) * 1e3:.0f} ms; "
        f"TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms p99 {percentile(ttft, 99) * 1e3:.0f} ms; "
        f"replica RSS growth {growth / 2**20:.1f} MB; leaked blocks 0"
    )

    in_stream = [out for out in problems if out.status == 200 and out.in_stream_error]
    assert not problems, (
        f"{len(problems)} neither completed nor refused before the first byte "
        f"({len(in_stream)} failed inside a 200 stream), e.g. {problems[:3]}"
    )
    assert len(completed) + len(refused) == ROUNDS * CLIENTS
    assert set(first) == set(second), "a replica restarted between the rounds"
    assert growth <= max(RSS_GROWTH_LIMIT, 0.10 * sum(first.values())), (first, second)
