"""OpenAI response bodies and SSE chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.api.openai_protocol import RequestError, error_body
from deploy.api.output import ChoiceAssembler, ChoiceDelta
from workers.protocol import TokenLogprobs


class ResponseBuilder:
    def __init__(
        self, request_id: str, model: str, tokenizer, chat: bool, num_prompt_tokens: int, return_timing: bool
    ) -> None:
        self.request_id, self.model, self.tokenizer, self.chat = request_id, model, tokenizer, chat
        self.num_prompt_tokens, self.return_timing = num_prompt_tokens, return_timing
        self.created = int(time.time())
        self._text_offset = 0

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    # ------------------------------------------------------------------ usage
    def usage(self, assemblers: list[ChoiceAssembler]) -> dict[str, Any]:
        completion = sum(len(a.token_ids) for a in assemblers)
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": max((a.num_cached_tokens for a in assemblers), default=0)},
        }
        if self.return_timing:
            usage["timing"] = assemblers[0].timing if len(assemblers) == 1 else [a.timing for a in assemblers]
        return usage

    # --------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if not entries:
            return None
        if self.chat:

            def item(tid: int, lp: float) -> dict:
                text = self._token_text(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}

            return {
                "content": [
                    {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
                ]
            }
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    # -------------------------------------------------------------- responses
    def final(self, assemblers: list[ChoiceAssembler]) -> dict:
        choices = []
        for index, a in enumerate(assemblers):
            self._text_offset = 0
            entries = a.logprobs
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": a.text}
                if a.tools is not None:
                    calls = a.tool_calls
                    message = {"role": "assistant", "content": (a.content or None) if calls else a.content}
                    if calls:
                        message["tool_calls"] = calls
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": self._logprobs(entries),
                        "finish_reason": a.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": a.text,
                        "logprobs": self._logprobs(entries),
                        "finish_reason": a.finish_reason,
                    }
                )
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, self.usage(assemblers))

    def first_chunk(self, n: int) -> dict:
        if self.chat:
            return self._envelope(
                "chat.completion.chunk",
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(n)
                ],
            )
        return self._envelope(
            "text_completion", [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(n)]
        )

    def chunk(self, index: int, delta: ChoiceDelta, assembler: ChoiceAssembler) -> dict:
        logprobs = self._logprobs(delta.logprobs)
        if self.chat:
            content: dict[str, Any] = {"content": delta.text} if delta.text else {}
            if delta.tool_calls:
                content["tool_calls"] = delta.tool_calls
            body = {
                "index": index,
                "delta": content,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [body])
        return self._envelope(
            "text_completion",
            [{"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}],
        )

    def usage_chunk(self, assemblers: list[ChoiceAssembler]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], self.usage(assemblers))

    def error_event(self, exc: BaseException) -> dict:
        if isinstance(exc, RequestError):
            return exc.body()
        return error_body(f"generation failed: {root_cause(exc)}", "server_error", None, "worker_failed")


def root_cause(exc: BaseException) -> BaseException:
    """The worker's own exception inside Ray's wrappers (a RayTaskError's ``cause``, whose text
    is a remote traceback with terminal colours): what a client's error message should name."""
    seen = {id(exc)}
    while isinstance(cause := getattr(exc, "cause", None), BaseException) and id(cause) not in seen:
        seen.add(id(cause))
        exc = cause
    return exc
