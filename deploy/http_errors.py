"""Errors as OpenAI shapes them: 400 for invalid input (FastAPI's 422 overridden), 401 without
a valid API key, 404 for an unknown model, 413 for an oversized body, 503 with Retry-After when
a pool is full. A 500 means a bug on our side, never something the client sent.

Serve runs a frozen copy of the module-level FastAPI app, so per-deployment settings (API keys,
the body limit) cannot live in ``app.state``: they live in ``SETTINGS`` here, which the
ingress's constructor fills in the replica process, and the handlers below are module-level
functions (pickled by reference, so they read this module's ``SETTINGS`` in the replica).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deploy.openai_protocol import RequestError, error_body

logger = logging.getLogger("pdserve")


@dataclass
class HTTPSettings:
    api_keys: frozenset[str] = frozenset()
    max_request_bytes: int = 1 << 20


SETTINGS = HTTPSettings()


def _open_path(path: str) -> bool:
    """Paths served without a key: the health probe, and the dashboard's page and assets (they
    hold no data; the page sends the key with its status calls)."""
    return path.endswith("/health") or path.endswith("/dashboard") or "/dashboard/static/" in path


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    if not parts:
        return None
    # "messages.0.content" names the field; drop pydantic's union-member labels like "str"
    keep = [p for p in parts if not (p[0].islower() and ("[" in p or p in ("str", "int", "list", "constrained-str")))]
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
    return JSONResponse(error_body(message, kind, None, None), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


class BodyTooLarge(Exception):
    pass


def _too_large(limit: int, size: str) -> JSONResponse:
    return JSONResponse(error_body(f"Request body of {size} bytes exceeds the limit of {limit} bytes",
                                   "invalid_request_error", None, "request_too_large"), status_code=413)


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
                        status_code=500)


async def auth_and_size(request: Request, call_next):
    if SETTINGS.api_keys and not _open_path(request.url.path):
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if token not in SETTINGS.api_keys:
            return JSONResponse(
                error_body("Missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key"), status_code=401)
    limit = SETTINGS.max_request_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return _too_large(limit, length)
    if length is None and request.method in ("POST", "PUT", "PATCH"):
        # Chunked upload: read it here, counting, so the limit holds without Content-Length.
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                return _too_large(limit, f"more than {limit}")
        request._body = bytes(body)  # Starlette serves later reads from this
    try:
        return await call_next(request)
    except RequestError as exc:
        return await request_error(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.middleware("http")(auth_and_size)
