"""Errors as OpenAI shapes them: 400 for invalid input (FastAPI's 422 overridden), 401 without
a valid API key, 404 for an unknown model, 413 for an oversized body, 503 with Retry-After when
a pool is full. A 500 means a bug on our side, never something the client sent.

Serve runs a frozen copy of the module-level FastAPI app, so per-deployment settings (API keys,
the body limit) cannot live in ``app.state``: they live in ``SETTINGS`` here, which the
ingress's constructor fills in the replica process, and the handlers below are module-level
functions (pickled by reference, so they read this module's ``SETTINGS`` in the replica).

A client that leaves is not an error. Serve tells the ingress in two ways: the request's task is
cancelled (``asyncio.CancelledError``), and the ASGI ``receive`` it hands the app raises Ray's
``TaskCancelledError`` (its fetch from the proxy was cancelled) instead of returning
``http.disconnect``. Starlette's ``BaseHTTPMiddleware`` ran ``receive`` in an anyio task group,
which wrapped that error in an ``ExceptionGroup`` and made every disconnect look like a crash
("unhandled error on /v1/chat/completions"). So the middleware here is plain ASGI, its
``receive`` turns those errors into ``http.disconnect``, and what still surfaces as a
cancellation (``is_cancellation``) is logged at DEBUG only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import TaskCancelledError  # Serve's RequestCancelledError is one too
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from deploy.api.openai_protocol import RequestError, error_body

if sys.version_info < (3, 11):  # a builtin from 3.11; before, anyio raises its backport's
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("pdserve")


@dataclass
class HTTPSettings:
    api_keys: frozenset[str] = frozenset()
    max_request_bytes: int = 1 << 20


SETTINGS = HTTPSettings()

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody receives it


def is_cancellation(exc: BaseException | None) -> bool:
    """Whether ``exc`` means "the client left / the call was cancelled", not a failure: an
    asyncio cancellation, a closed generator, Ray's or Serve's cancellation errors (also as the
    cause of a Ray task error), Starlette's ClientDisconnect, or a group holding only those."""
    if exc is None:
        return False
    if isinstance(exc, BaseExceptionGroup):
        return all(is_cancellation(e) for e in exc.exceptions)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, TaskCancelledError, ClientDisconnect)):
        return True
    cause = getattr(exc, "cause", None)  # RayTaskError carries the callee's exception here
    return cause is not exc and isinstance(cause, BaseException) and is_cancellation(cause)


def _open_path(path: str) -> bool:
    """Paths served without a key: the health probe, and the dashboard's page and assets (they
    hold no data; the page sends the key with its status calls)."""
    return path.endswith("/health") or path.endswith("/dashboard") or "/dashboard/static/" in path


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    if not parts:
        return None
    # "messages.0.content" names the field; drop pydantic's union-member labels like "str"
    keep = [p for p in parts if not (p[:1].islower() and ("[" in p or p in ("str", "int", "list", "constrained-str")))]
    return ".".join(keep or parts[:1])


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _param_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message, param = f"Request body is not valid JSON: {first.get('msg')}", None
    else:
        message = "; ".join(f"{_param_of(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


async def request_error(request: Request, exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Framework errors (unknown path, wrong method, unparsable body) in OpenAI's shape."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:
        message = f"Request body is not valid JSON in UTF-8: {message}"
    return JSONResponse(
        error_body(message, kind, None, None), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


class BodyTooLarge(Exception):
    pass


def _too_large(limit: int, size: str) -> JSONResponse:
    return JSONResponse(
        error_body(
            f"Request body of {size} bytes exceeds the limit of {limit} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        ),
        status_code=413,
    )


def _client_closed() -> JSONResponse:
    return JSONResponse(
        error_body("client closed the request", "invalid_request_error", None, "client_closed_request"),
        status_code=CLIENT_CLOSED_REQUEST,
    )


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    if is_cancellation(exc):  # the client left: nothing failed, and nobody reads this answer
        logger.debug("client of %s left (%s)", request.url.path, type(exc).__name__)
        return _client_closed()
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(
        error_body(f"internal error: {type(exc).__name__}", "server_error", None, None), status_code=500
    )


def _disconnect_on_cancel(receive):
    """``receive``, with Ray's cancellation of Serve's proxy fetch read as a disconnect."""

    async def wrapped():
        try:
            return await receive()
        except Exception as exc:  # noqa: BLE001 - only cancellations are translated
            if is_cancellation(exc):
                return {"type": "http.disconnect"}
            raise

    return wrapped


def _replay(body: bytes, receive):
    """``receive`` that first hands out a body already read, then the connection's messages."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


class AuthAndSize:
    """Pure ASGI middleware (no task group, see the module docstring): API keys, the body limit
    (also for chunked uploads, read here while counting), and disconnects as disconnects.

    Module-level, so Serve pickles it by reference and it reads this module's ``SETTINGS``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = _disconnect_on_cancel(receive)
        headers = Headers(scope=scope)
        if SETTINGS.api_keys and not _open_path(scope.get("path", "")):
            header = headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if token not in SETTINGS.api_keys:
                await JSONResponse(
                    error_body(
                        "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                        None,
                        "invalid_api_key",
                    ),
                    status_code=401,
                )(scope, receive, send)
                return
        limit = SETTINGS.max_request_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(limit, length)(scope, receive, send)
            return
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # Chunked upload: read it here, counting, so the limit holds without Content-Length.
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left mid-upload
                body += message.get("body", b"")
                if len(body) > limit:
                    await _too_large(limit, f"more than {limit}")(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except RequestError as exc:
            if started:
                raise
            await (await request_error(Request(scope), exc))(scope, receive, send)
        except Exception as exc:
            if not is_cancellation(exc):
                raise
            # The client left while the route ran (asyncio's own cancellation is not caught
            # here: it propagates, as it must). Nothing failed; nobody reads an answer.
            logger.debug("client of %s left (%s)", scope.get("path"), type(exc).__name__)
            if not started:
                with contextlib.suppress(Exception):
                    await _client_closed()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    # Starlette types every handler as taking any Exception, though it calls each with its own
    # class only (Kludex/starlette#2403): the ignores below are that, nothing else.
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(RequestError, request_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, server_error)
    app.add_middleware(AuthAndSize)
