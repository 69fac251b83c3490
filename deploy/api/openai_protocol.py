"""OpenAI-compatible request bodies, validated at the boundary, and the error body.

Validation errors carry the offending parameter so the ingress can answer 400 with
``{"error": {"message", "type", "param", "code"}}`` as OpenAI does.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.error_type, self.code = message, param, status, error_type, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class MigrateRequest(BaseModel):
    """``POST /v1/cluster/migrate``: move a running request's decode streams live."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=256)  # a completion's id moves all its choices
    recompute: bool = False  # move by recomputing prompt + tokens on the other replica instead


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


# Fields OpenAI's server accepts that change nothing here (pdserve keeps no stored completions,
# has one service tier, and generates text only); anything else unknown is a 400 naming it.
NO_OP_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "modalities")


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid", str_max_length=1_000_000)

    model: str = Field(min_length=1, description="served model id (GET /v1/models)")
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0: disabled")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256, description="separates this tenant's prefix cache from others'"
    )
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = Field(default=None, max_length=64)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the no-op fields (NO_OP_FIELDS) besides user
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    modalities: list[Literal["text"]] | None = None
    return_timing: bool = Field(default=False, description="pdserve: per-request timing in usage")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="pdserve: this request's context limit (prompt + completion tokens), "
        "at most the deployment's; e.g. a cap on a conversation's growth",
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for token, bias in (v or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids; {token!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} of token {token} is outside [-100, 100]")
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v):
        if v:
            raise ValueError("stored completions are not supported; leave store false")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if v and any(not w.strip() for w in v):
            raise ValueError("bad words must not be empty")
        return v

    def constraint(self) -> tuple[str, str, str] | None:
        """The request's output constraint as (param, kind, spec), or None. More than one is a
        RequestError naming the second; so is a spec that is not a grammar."""
        found: list[tuple[str, str, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf is not None and rf.json_schema is not None:
            found.append(("response_format", "json_schema", json.dumps(rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            given = [
                (k, v)
                for k, v in (
                    ("json_schema", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                    ("json_object", so.json_object or None),
                    ("structural_tag", so.structural_tag),
                )
                if v is not None
            ]
            if len(given) != 1:
                raise RequestError("structured_outputs takes exactly one constraint", "structured_outputs")
            found.append(("structured_outputs", given[0][0], _spec_text(given[0][1])))
        for param, kind in (
            ("guided_json", "json_schema"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, param)
            if value is not None:
                found.append((param, kind, _spec_text(value)))
        if len(found) > 1:
            raise RequestError(f"{found[1][0]} conflicts with {found[0][0]}: give one output constraint", found[1][0])
        if not found:
            return None
        param, kind, spec = found[0]
        from workers.engine.structured import GrammarError, check_spec

        try:
            check_spec(kind, "" if kind == "json_object" else spec)
        except GrammarError as exc:
            raise RequestError(f"{param} is not a grammar pdserve can follow: {exc}", param) from exc
        return found[0]

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="text or token ids")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported (pdserve returns every choice it generates)")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], list) or isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported: send one prompt per request")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("prompt token ids must be a non-empty list of non-negative integers")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v


def _spec_text(value: Any) -> str:
    """A constraint's spec as the engine takes it: JSON for schemas and choices, else the text."""
    if isinstance(value, str):
        return value
    if value is True:
        return ""
    return json.dumps(value)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # assistant messages: the calls it made (deploy/api/tools.py validates them); tool messages:
    # which call this result answers
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    # what the SDK sends back of an earlier response's message: harmless when empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # deploy/api/tools.py validates these (plan_tools), naming the parameter
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
