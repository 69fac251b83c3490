"""The client: streams each request and times its chunks; sends a workload at its arrival rate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Any

import httpx
import numpy as np

from deploy.ops.loadgen.config import CHAT, REFUSED_STATUSES, BenchConfig, BenchmarkError
from deploy.ops.loadgen.results import BenchmarkResult, RequestResult, summarize
from deploy.ops.loadgen.workloads import Conversation, Prompt, Workload, build_workload

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
    units: tuple[Prompt | Conversation, ...] = workload.prompts or workload.conversations
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
