"""A client that leaves is an abort, not a failure: the ingress counts each choice as finished,
aborted or failed, reads Ray's and Serve's cancellation errors as cancellations, and its HTTP
layer treats a cancelled receive as a disconnect (no "unhandled error", no ExceptionGroup)."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import RequestCancelledError
from starlette.requests import ClientDisconnect

from deploy.api import http_errors
from deploy.api.http_errors import install_error_handlers, is_cancellation
from deploy.api.request_stats import OUTCOMES, RequestStats

if sys.version_info < (3, 11):  # builtins from 3.11; anyio's backport before
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup


# ------------------------------------------------------------------ counting
def test_each_outcome_has_its_own_counter():
    stats = RequestStats()
    for _ in range(4):  # then ended as finished, aborted, aborted, failed
        stats.begin(prompt_tokens=10)
    assert stats.active == 4 and stats.started == 4 and stats.prompt_tokens == 40
    stats.end("finished", e2e_s=0.5)
    stats.end("aborted")
    stats.end("aborted")
    stats.end("failed")
    snap = stats.snapshot()
    assert (snap["finished"], snap["aborted"], snap["failed"], snap["active"]) == (1, 2, 1, 0)
    assert snap["e2e_s"]["p50"] == 0.5  # only finished choices have an end-to-end latency
    with pytest.raises(ValueError, match="outcome"):
        stats.end("cancelled")
    assert set(OUTCOMES) == {"finished", "aborted", "failed"}


class _RayTaskErrorLike(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@pytest.mark.parametrize(
    "exc, expected",
    [
        (asyncio.CancelledError(), True),
        (GeneratorExit(), True),
        (TaskCancelledError(), True),
        (RequestCancelledError("req-1"), True),
        (ClientDisconnect(), True),
        (ExceptionGroup("tg", [TaskCancelledError()]), True),  # what BaseHTTPMiddleware's task group raised
        (BaseExceptionGroup("tg", [asyncio.CancelledError(), TaskCancelledError()]), True),
        (_RayTaskErrorLike(TaskCancelledError()), True),  # a callee's cancellation, as Ray wraps it
        (ExceptionGroup("tg", [TaskCancelledError(), ValueError("boom")]), False),
        (RuntimeError("worker died"), False),
        (_RayTaskErrorLike(RuntimeError("boom")), False),
        (None, False),
    ],
)
def test_is_cancellation(exc, expected):
    assert is_cancellation(exc) is expected


# ------------------------------------------------------------------ the ingress's choice loop
class _Chunk:
    def __init__(self, token_ids, finish_reason=None):
        self.token_ids, self.finish_reason = token_ids, finish_reason
        self.logprobs, self.num_cached_tokens, self.timing = None, 0, None


class _Assembler:
    def __init__(self):
        self.finish_reason, self.num_cached_tokens, self.timing = None, 0, {}

    def add(self, token_ids, logprobs, finish_reason):
        self.finish_reason = finish_reason
        return token_ids


class _Metrics:
    def __init__(self):
        self.outcomes = []

    def first_token(self, *args):
        pass

    def token_gap(self, *args):
        pass

    def finished(self, e2e_s, outcome):
        self.outcomes.append(outcome)


class _Workers:
    """Streams chunks from `script`: a list of chunks, "hang" (wait forever) or an exception."""

    def __init__(self, script):
        self.script = script
        self.closed = False

    async def generate(self, choice):
        try:
            for step in self.script:
                if step == "hang":
                    await asyncio.Event().wait()
                if isinstance(step, BaseException):
                    raise step
                yield step
        finally:
            self.closed = True  # the real one cancels the worker's call here: the worker aborts


def _ingress(script):
    from deploy.api.ingress import OpenAIIngress

    class Ingress(OpenAIIngress.func_or_class):  # the class Serve runs, built without __init__
        def __del__(self):  # Serve's wrapper has an async one, for a replica's shutdown
            pass

    ingress = object.__new__(Ingress)
    ingress.stats, ingress.metrics, ingress.workers = RequestStats(), _Metrics(), _Workers(script)
    ingress.conversations = None
    return ingress


def _choice():
    from workers.protocol import GenerateRequest

    return GenerateRequest("cmpl-test-0", (1, 2, 3), {"max_tokens": 8}, None, (), 0.0)


async def _consume(ingress) -> None:
    async for _ in ingress._choice_deltas(_choice(), _Assembler()):
        pass


def test_client_leaving_counts_as_aborted_not_failed():
    ingress = _ingress([_Chunk((5,)), "hang"])

    async def main():
        task = asyncio.create_task(_consume(ingress))
        while ingress.stats.completion_tokens == 0:
            await asyncio.sleep(0.01)
        task.cancel()  # what Serve does to the request's task when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert (ingress.stats.aborted, ingress.stats.failed, ingress.stats.finished, ingress.stats.active) == (1, 0, 0, 0)
    assert ingress.metrics.outcomes == ["aborted"]
    assert ingress.workers.closed  # the workers' stream was closed: their abort path frees the blocks


def test_closing_the_stream_early_counts_as_aborted():
    ingress = _ingress([_Chunk((5,)), _Chunk((6,)), "hang"])

    async def main():
        deltas = ingress._choice_deltas(_choice(), _Assembler())
        await anext(deltas)
        await deltas.aclose()  # a streaming response torn down after its first chunk

    asyncio.run(main())
    assert (ingress.stats.aborted, ingress.stats.failed) == (1, 0)
    assert ingress.workers.closed


def test_a_cancelled_worker_call_counts_as_aborted():
    ingress = _ingress([_Chunk((5,)), RequestCancelledError("cmpl-test")])
    with pytest.raises(RequestCancelledError):
        asyncio.run(_consume(ingress))
    assert (ingress.stats.aborted, ingress.stats.failed) == (1, 0)


def test_a_worker_failure_counts_as_failed_and_a_finish_as_finished():
    failing = _ingress([_Chunk((5,)), RuntimeError("decode replica died")])
    with pytest.raises(RuntimeError):
        asyncio.run(_consume(failing))
    assert (failing.stats.failed, failing.stats.aborted) == (1, 0)
    assert failing.metrics.outcomes == ["failed"]

    done = _ingress([_Chunk((5,)), _Chunk((6,), finish_reason="length")])
    asyncio.run(_consume(done))
    assert (done.stats.finished, done.stats.failed, done.stats.aborted, done.stats.active) == (1, 0, 0, 0)
    assert done.metrics.outcomes == ["finished"]


# ------------------------------------------------------------------ the HTTP layer
def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/stream")
    async def stream():
        async def gen():
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.005)

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/echo")
    async def echo(body: dict):
        return body

    @app.post("/cancelled")
    async def cancelled():
        raise TaskCancelledError()  # a downstream call cancelled because the client left

    return app


def _scope(path: str, headers=((b"content-length", b"0"),)) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": list(headers),
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


def test_a_cancelled_receive_mid_stream_is_a_disconnect(caplog):
    """Serve's receive raises TaskCancelledError when the client leaves; Starlette's streaming
    response listens on receive. That was "unhandled error … ExceptionGroup … TaskCancelledError"."""
    app = _app()
    sent: list[str] = []
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.05)
        raise TaskCancelledError()

    async def send(message):
        sent.append(message["type"])

    with caplog.at_level(logging.DEBUG, logger="pdserve"):
        asyncio.run(app(_scope("/stream"), receive, send))  # returns: no exception escapes
    assert sent[0] == "http.response.start" and len(sent) < 1000  # the stream stopped at the disconnect
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


def test_a_cancellation_raised_by_a_route_is_not_a_server_error(caplog):
    with caplog.at_level(logging.DEBUG, logger="pdserve"):
        resp = TestClient(_app(), raise_server_exceptions=False).post("/cancelled")
    assert resp.status_code == http_errors.CLIENT_CLOSED_REQUEST  # nobody reads it: the client left
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


def test_the_plain_asgi_middleware_keeps_keys_and_the_body_limit(monkeypatch):
    monkeypatch.setattr(http_errors, "SETTINGS", http_errors.HTTPSettings(frozenset({"k"}), 2048))
    client = TestClient(_app())
    assert client.post("/echo", json={"a": 1}).status_code == 401
    wrong = client.post("/echo", json={"a": 1}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer k"}
    assert client.post("/echo", json={"a": 1}, headers=auth).json() == {"a": 1}
    big = client.post("/echo", json={"a": "x" * 4000}, headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def chunks(total: int):
        body = ('{"a": "' + "y" * (total - 9) + '"}').encode()
        for i in range(0, len(body), 512):
            yield body[i : i + 512]

    # no Content-Length (chunked): counted while read, then replayed to the route
    json_auth = {**auth, "Content-Type": "application/json"}
    assert client.post("/echo", content=chunks(1000), headers=json_auth).json() == {"a": "y" * 991}
    chunked_big = client.post("/echo", content=chunks(5000), headers=json_auth)
    assert chunked_big.status_code == 413 and "more than 2048" in chunked_big.json()["error"]["message"]
