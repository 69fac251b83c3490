"""OpenAI-compatible request bodies, validated at the boundary, and the error body.

Validation errors carry the offending parameter so the ingress can answer 400 with
``{"error": {"message", "type", "param", "code"}}`` as OpenAI does.
"""

from __future__ import annotations

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore", str_max_length=1_000_000)

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v):
        if v != 0.0:
            raise ValueError("penalties are not supported; leave it at 0")
        return v

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

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

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
