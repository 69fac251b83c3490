"""The ingress under hostile input: the OpenAPI schema fuzzed with schemathesis (valid and
invalid bodies), then hand-written bad requests. Nothing a client sends may yield a 5xx; every
4xx carries OpenAI's error body; afterwards every replica's blocks are free again."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import deploy, wait_idle

pytestmark = pytest.mark.timeout(600)
APP, PREFIX, MODEL = "fuzz", "/fuzz", "llama"
MAX_REQUEST_BYTES = 65536
MAX_GEN_TOKENS, MAX_CHOICES = 4, 2  # fuzzed generations stay short on 2 shared cores
EXAMPLES = {"POST /v1/completions": 60, "POST /v1/chat/completions": 60}  # GETs: 10 each
REQUEST_TIMEOUT_S = 30.0

TRIED: Counter = Counter()  # "requests", "4xx", "5xx" over the whole module
VIOLATIONS: list[str] = []  # 5xx answers and 4xx answers without OpenAI's error body


@pytest.fixture(scope="module")
def fuzz_app(serve_cluster, tiny_llama):
    from ray import serve

    args = {
        "model": tiny_llama,
        "served_model_name": MODEL,
        "redis_url": serve_cluster.redis.url,
        "num_kv_blocks": 256,
        "device": "cpu",
        "transfer_timeout_s": 10.0,
        "lease_ttl_s": 10.0,
        "max_request_bytes": MAX_REQUEST_BYTES,
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
    }
    base = deploy(serve_cluster, APP, PREFIX, args)
    yield base
    serve.delete(APP)


def check_response(status: int, text: str, what: str) -> dict | None:
    """Count one answer. A 5xx, or a 4xx without OpenAI's error body, is recorded in VIOLATIONS;
    a well-formed 4xx returns its ``error`` object."""
    TRIED["requests"] += 1
    if status >= 500:
        TRIED["5xx"] += 1
        VIOLATIONS.append(f"{status} for {what[:300]}: {text[:300]}")
        return None
    if status < 400:
        return None
    TRIED["4xx"] += 1
    try:
        error = json.loads(text)["error"]
        well_formed = set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    except (ValueError, KeyError, TypeError):
        well_formed = False
    if not well_formed:
        VIOLATIONS.append(f"{status} without OpenAI's error body for {what[:300]}: {text[:300]}")
        return None
    return error


def assert_no_violations(since: int) -> None:
    found = VIOLATIONS[since:]
    distinct = sorted({v.split(" for ")[0] + " " + v.rsplit(": ", 1)[-1] for v in found})
    assert not found, f"{len(found)} violations, {len(distinct)} kinds: {distinct}\nfirst: {found[:5]}"


def _is_count(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bounded(body: Any, use_served_model: bool) -> Any:
    """Keep valid generations short (max_tokens, n) and, half the time, name the served model so
    fuzzed bodies reach tokenization and the workers instead of stopping at the 404."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if use_served_model:  # and leave unsupported extensions neutral: more bodies reach the workers
        body["model"] = MODEL
        for key in ("echo", "suffix"):
            body.pop(key, None)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_GEN_TOKENS  # absent/null means "up to the context": too long here
    for key in ("max_tokens", "max_completion_tokens"):
        if _is_count(body.get(key)) and MAX_GEN_TOKENS < body[key] <= 4096:
            body[key] = MAX_GEN_TOKENS
    if _is_count(body.get("n")) and MAX_CHOICES < body["n"] <= 16:
        body["n"] = MAX_CHOICES
    return body


def test_schema_fuzz_never_5xx(fuzz_app):
    schemathesis = pytest.importorskip("schemathesis")  # the test extras install it
    from schemathesis import GenerationMode

    since = len(VIOLATIONS)
    schema = schemathesis.openapi.from_url(f"{fuzz_app}/openapi.json", wait_for_schema=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert set(EXAMPLES) <= labels, labels

    for op in operations:
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        _fuzz_operation(op, modes, fuzz_app)
    assert_no_violations(since)


def _fuzz_operation(op, modes: list, base_url: str) -> None:
    """Call one operation with its generated cases (each with its own label in a failure)."""

    @settings(
        max_examples=EXAMPLES.get(op.label, 10),
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(*(op.as_strategy(mode) for mode in modes)), use_served_model=st.booleans())
    def call(case, use_served_model):
        if case.body is not None and not isinstance(case.body, (bytes, str)):
            case.body = bounded(case.body, use_served_model)
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        check_response(response.status_code, response.text, f"{op.label} {case.body!r}")

    call()


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _nested(depth: int) -> bytes:
    return b'{"model": "llama", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


MAX_MODEL_LEN = 2048  # the tiny llama's max_position_embeddings (checked against /v1/models below)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (id, path, request kwargs, status, param (None: not checked), code (None: not checked), words in the message)
BAD_INPUTS = [
    ("malformed_json", COMPLETIONS, {"content": b'{"model": "llama", "prompt": '}, 400, None, None, "json"),
    ("not_utf8", COMPLETIONS, {"content": b"\xff\xfe\x00"}, 400, None, None, "json"),
    ("nested_too_deep", COMPLETIONS, {"content": _nested(20_000)}, 400, None, None, ""),
    ("body_is_a_list", COMPLETIONS, {"json": []}, 400, None, None, ""),
    ("body_is_null", COMPLETIONS, {"json": None}, 400, None, None, ""),
    ("prompt_dict", COMPLETIONS, {"json": _completion(prompt={"text": "hi"})}, 400, "prompt", None, "prompt"),
    ("prompt_missing", COMPLETIONS, {"json": {"model": MODEL}}, 400, "prompt", None, "prompt"),
    ("model_missing", COMPLETIONS, {"json": {"prompt": "hi"}}, 400, "model", None, "model"),
    ("max_tokens_string", COMPLETIONS, {"json": _completion(max_tokens="many")}, 400, "max_tokens", None, "max_tokens"),
    ("messages_string", CHAT, {"json": {"model": MODEL, "messages": "hi"}}, 400, "messages", None, "messages"),
    ("max_tokens_negative", COMPLETIONS, {"json": _completion(max_tokens=-5)}, 400, "max_tokens", None, "max_tokens"),
    ("max_tokens_zero", CHAT, {"json": _chat(max_tokens=0)}, 400, "max_tokens", None, "max_tokens"),
    (
        "max_tokens_huge",
        COMPLETIONS,
        {"json": _completion(max_tokens=10**9)},
        400,
        "max_tokens",
        "context_length_exceeded",
        "context length",
    ),
    (
        "max_tokens_bigint",
        COMPLETIONS,
        {"json": _completion(max_tokens=2**80)},
        400,
        "max_tokens",
        "context_length_exceeded",
        "context length",
    ),
    (
        "max_completion_tokens_huge",
        CHAT,
        {"json": _chat(max_completion_tokens=10**6)},
        400,
        "max_tokens",
        "context_length_exceeded",
        "context length",
    ),
    ("prompt_empty", COMPLETIONS, {"json": _completion(prompt="")}, 400, "prompt", None, "empty"),
    ("prompt_empty_list", COMPLETIONS, {"json": _completion(prompt=[])}, 400, "prompt", None, "empty"),
    ("prompt_batched", COMPLETIONS, {"json": _completion(prompt=[[1, 2], [3]])}, 400, "prompt", None, "batched"),
    ("prompt_negative_ids", COMPLETIONS, {"json": _completion(prompt=[5, -1])}, 400, "prompt", None, "non-negative"),
    (
        "prompt_ids_outside_vocab",
        COMPLETIONS,
        {"json": _completion(prompt=[5, 10**9])},
        400,
        "prompt",
        None,
        "vocabulary",
    ),
    ("messages_empty", CHAT, {"json": {"model": MODEL, "messages": []}}, 400, "messages", None, "at least 1"),
    (
        "prompt_over_context",
        COMPLETIONS,
        {"json": _completion(prompt=[5] * (MAX_MODEL_LEN + 1))},
        400,
        "prompt",
        "context_length_exceeded",
        "context length",
    ),
    (
        "prompt_fills_context",
        COMPLETIONS,
        {"json": _completion(prompt=[5] * MAX_MODEL_LEN)},
        400,
        "prompt",
        "context_length_exceeded",
        "context length",
    ),
    (
        "prompt_plus_max_tokens_over_context",
        COMPLETIONS,
        {"json": _completion(prompt=[5] * (MAX_MODEL_LEN - 4), max_tokens=16)},
        400,
        "max_tokens",
        "context_length_exceeded",
        "context length",
    ),
    (
        "unknown_model",
        COMPLETIONS,
        {"json": _completion(model="gpt-4")},
        404,
        "model",
        "model_not_found",
        "does not exist",
    ),
    ("unknown_model_chat", CHAT, {"json": _chat(model="gpt-4")}, 404, "model", "model_not_found", "does not exist"),
    (
        "oversized_body",
        COMPLETIONS,
        {"json": _completion(prompt="x" * (MAX_REQUEST_BYTES + 10))},
        413,
        None,
        "request_too_large",
        "exceeds",
    ),
    (
        "stream_options_without_stream",
        COMPLETIONS,
        {"json": _completion(stream_options={"include_usage": True})},
        400,
        None,
        None,
        "stream_options",
    ),
    (
        "stream_options_stream_false",
        CHAT,
        {"json": _chat(stream=False, stream_options={"include_usage": True})},
        400,
        None,
        None,
        "stream_options",
    ),
    ("n_too_large", COMPLETIONS, {"json": _completion(n=17)}, 400, "n", None, "n"),
    ("n_zero", CHAT, {"json": _chat(n=0)}, 400, "n", None, "n"),
    ("logprobs_too_large", COMPLETIONS, {"json": _completion(logprobs=21)}, 400, "logprobs", None, "logprobs"),
    (
        "top_logprobs_too_large",
        CHAT,
        {"json": _chat(logprobs=True, top_logprobs=21)},
        400,
        "top_logprobs",
        None,
        "top_logprobs",
    ),
    ("top_logprobs_without_logprobs", CHAT, {"json": _chat(top_logprobs=3)}, 400, None, None, "top_logprobs"),
    ("top_p_zero", COMPLETIONS, {"json": _completion(top_p=0)}, 400, "top_p", None, "top_p"),
    ("top_p_above_one", CHAT, {"json": _chat(top_p=1.5)}, 400, "top_p", None, "top_p"),
    (
        "top_p_nan",
        COMPLETIONS,
        {"content": b'{"model": "llama", "prompt": "hi", "top_p": NaN}'},
        400,
        "top_p",
        None,
        "top_p",
    ),
    (
        "temperature_negative",
        COMPLETIONS,
        {"json": _completion(temperature=-0.5)},
        400,
        "temperature",
        None,
        "temperature",
    ),
    ("temperature_too_high", CHAT, {"json": _chat(temperature=2.5)}, 400, "temperature", None, "temperature"),
    (
        "temperature_infinite",
        COMPLETIONS,
        {"content": b'{"model": "llama", "prompt": "hi", "temperature": Infinity}'},
        400,
        "temperature",
        None,
        "temperature",
    ),
    (
        "temperature_string",
        COMPLETIONS,
        {"json": _completion(temperature="hot")},
        400,
        "temperature",
        None,
        "temperature",
    ),
    ("seed_negative", COMPLETIONS, {"json": _completion(seed=-1)}, 400, "seed", None, "seed"),
    ("seed_too_big", COMPLETIONS, {"json": _completion(seed=2**64)}, 400, "seed", None, "seed"),
    ("stop_empty_string", COMPLETIONS, {"json": _completion(stop=[""])}, 400, "stop", None, "stop"),
    ("stop_too_many", COMPLETIONS, {"json": _completion(stop=[f"s{i}" for i in range(17)])}, 400, "stop", None, "stop"),
    ("penalty_out_of_range", CHAT, {"json": _chat(presence_penalty=2.5)}, 400, "presence_penalty", None, "2"),
    ("unknown_field", CHAT, {"json": _chat(frobnicate=1)}, 400, "frobnicate", None, "Extra inputs"),
    (
        "schema_not_a_grammar",
        CHAT,
        {
            "json": _chat(
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}
            )
        },
        400,
        "response_format",
        None,
        "Unsupported type",
    ),
    ("regex_not_a_grammar", COMPLETIONS, {"json": _completion(guided_regex="[a-")}, 400, "guided_regex", None, "regex"),
    (
        "two_constraints",
        CHAT,
        {"json": _chat(response_format={"type": "json_object"}, guided_choice=["a", "b"])},
        400,
        "guided_choice",
        None,
        "conflicts",
    ),
    (
        "tool_choice_unknown_function",
        CHAT,
        {
            "json": _chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            )
        },
        400,
        "tool_choice",
        None,
        "g",
    ),
    (
        "logit_bias_outside_vocab",
        COMPLETIONS,
        {"json": _completion(logit_bias={"10000000": 1})},
        400,
        "logit_bias",
        None,
        "vocabulary",
    ),
    (
        "min_tokens_over_max",
        COMPLETIONS,
        {"json": _completion(min_tokens=9, max_tokens=3)},
        400,
        "min_tokens",
        None,
        "min_tokens",
    ),
    ("echo_unsupported", COMPLETIONS, {"json": _completion(echo=True)}, 400, "echo", None, "echo"),
    ("user_too_long", COMPLETIONS, {"json": _completion(user="u" * 300)}, 400, "user", None, "user"),
    (
        "unknown_role",
        CHAT,
        {"json": {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}},
        400,
        "messages.0.role",
        None,
        "role",
    ),
    (
        "role_missing",
        CHAT,
        {"json": {"model": MODEL, "messages": [{"content": "hi"}]}},
        400,
        "messages.0.role",
        None,
        "role",
    ),
    (
        "image_content_part",
        CHAT,
        {
            "json": {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}],
                    }
                ],
            }
        },
        400,
        "messages.0.content",
        None,
        "content",
    ),
    (
        "text_part_without_text",
        CHAT,
        {"json": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}},
        400,
        "messages.0.content",
        None,
        "text",
    ),
    (
        "message_not_an_object",
        CHAT,
        {"json": {"model": MODEL, "messages": ["hi"]}},
        400,
        "messages.0",
        None,
        "messages",
    ),
]


@pytest.mark.parametrize(
    "path, request_kwargs, status, param, code, words",
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_gets_named_4xx(fuzz_app, path, request_kwargs, status, param, code, words):
    headers = {"content-type": "application/json"} if "content" in request_kwargs else None
    resp = httpx.post(f"{fuzz_app}{path}", headers=headers, timeout=REQUEST_TIMEOUT_S, **request_kwargs)
    error = check_response(resp.status_code, resp.text, f"{path} {request_kwargs!r:.200}")
    assert resp.status_code == status, resp.text
    assert error is not None, resp.text  # OpenAI's error body
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert words.lower() in error["message"].lower(), error


def test_routing_errors_carry_openai_body(fuzz_app):
    """404 (unknown path) and 405 (wrong method) from the framework use OpenAI's body too."""
    since = len(VIOLATIONS)
    models = httpx.get(f"{fuzz_app}/v1/models", timeout=REQUEST_TIMEOUT_S).json()["data"][0]
    assert models["max_model_len"] == MAX_MODEL_LEN  # the BAD_INPUTS table relies on it

    resp = httpx.get(f"{fuzz_app}/v1/completions", timeout=REQUEST_TIMEOUT_S)
    check_response(resp.status_code, resp.text, "GET /v1/completions")
    assert resp.status_code == 405, resp.text
    resp = httpx.post(f"{fuzz_app}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=REQUEST_TIMEOUT_S)
    check_response(resp.status_code, resp.text, "POST /v1/embeddings")
    assert resp.status_code == 404, resp.text

    assert_no_violations(since)


def test_chunked_oversized_body_is_refused(fuzz_app):
    """Without a Content-Length the limit must still hold (else a client streams any size)."""
    payload = json.dumps(_completion(prompt="x" * (MAX_REQUEST_BYTES + 10))).encode()

    def chunks():
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    resp = httpx.post(
        f"{fuzz_app}{COMPLETIONS}",
        content=chunks(),
        timeout=REQUEST_TIMEOUT_S,
        headers={"content-type": "application/json"},
    )
    error = check_response(resp.status_code, resp.text, "chunked oversized body")
    assert resp.status_code == 413 and error and error["code"] == "request_too_large", resp.text


def test_nothing_leaked_and_no_5xx(fuzz_app):
    # a good request still works after all of the above
    resp = httpx.post(
        f"{fuzz_app}{COMPLETIONS}", json=_completion(max_tokens=4, temperature=0), timeout=REQUEST_TIMEOUT_S
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text
    wait_idle(fuzz_app)
    valid = TRIED["requests"] - TRIED["4xx"] - TRIED["5xx"]
    print(f"\nbad inputs tried: {TRIED['requests']}, 5xx: {TRIED['5xx']}")
    print(
        f"({TRIED['4xx']} answered 4xx, {len(VIOLATIONS) - TRIED['5xx']} of them without OpenAI's body; "
        f"{valid} valid and served)"
    )
    assert TRIED["5xx"] == 0, "\n".join(VIOLATIONS)
