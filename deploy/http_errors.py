"""Errors as OpenAI shapes them: 400 for invalid input (FastAPI's 422 overridden), 401 without
a valid API key, 404 for an unknown model, 413 for an oversized body, 503 when no worker can
take the request. A 500 means a bug on our side, never something the client sent."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from deploy.openai_protocol import RequestError, error_body

logger = logging.getLogger("pdserve")

OPEN_PATHS = frozenset({"/health"})


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    if not parts:
        return None
    # "messages.0.content" names the field; drop pydantic's union-member labels like "str"
    keep = [p for p in parts if not (p[0].islower() and ("[" in p or p in ("str", "int", "list")))]
    return ".".join(keep or parts[:1])


def install_error_handlers(app: FastAPI) -> None:
    app.state.api_keys = frozenset()
    app.state.max_request_bytes = 1 << 20

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_of(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = f"Request body is not valid JSON: {first.get('msg')}", None
        else:
            message = "; ".join(
                f"{_param_of(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5])
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
                            status_code=500)

    @app.middleware("http")
    async def _auth_and_size(request: Request, call_next):
        keys = request.app.state.api_keys
        if keys and request.url.path not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if token not in keys:
                return JSONResponse(
                    error_body("Missing or invalid API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", None, "invalid_api_key"), status_code=401)
        limit = request.app.state.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return JSONResponse(
                error_body(f"Request body of {length} bytes exceeds the limit of {limit} bytes",
                           "invalid_request_error", None, "request_too_large"), status_code=413)
        try:
            return await call_next(request)
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
