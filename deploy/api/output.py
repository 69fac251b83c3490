"""Turns a choice's token chunks into text deltas: incremental detokenization, stop strings
(with streamed text held back while it could still be the start of a stop string), and OpenAI
logprobs entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploy.api.tools import StreamingToolParser, finish_reason_with_tools
from workers.engine.detokenizer import IncrementalDetokenizer, TokenDecoder, find_stop_cut
from workers.protocol import TokenLogprobs


@dataclass(slots=True)
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # streaming delta entries


@dataclass
class ChoiceAssembler:
    tokenizer: TokenDecoder
    prompt_token_ids: list[int]
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    stopped_by_string: bool = False  # the text ends at a stop string, maybe mid-token
    timing: dict = field(default_factory=dict)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A chat request with tools: the choice's tool-call parser (deploy/api/tools.py), fed the
    # text as it is released; what it passes on is the message's content, the rest its calls.
    tools: StreamingToolParser | None = None
    content: str = ""  # with tools: the text released as content
    _emitted: int = 0  # characters of detok.text already sent

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.skip_special_tokens)
        self._hold = max(map(len, self.stop), default=1) - 1

    @property
    def text(self) -> str:
        return self._detok.text

    def add(self, token_ids, logprobs, finish_reason: str | None) -> ChoiceDelta:
        """Feed the next tokens; ``finish_reason`` from the worker (None while running).

        Returns the text that may be sent now. Sets ``finish_reason`` to "stop" when a stop
        string ends the text: the caller then stops the worker's stream.
        """
        new_ids: list[int] = []
        detok = self._detok
        stopped = False
        for token in token_ids:
            new_ids.append(token)
            piece = detok.add(token)
            cut = find_stop_cut(detok.text, len(piece), self.stop, self.include_stop_str_in_output)
            if cut is not None:
                detok.text = detok.text[:cut]
                stopped = True
                break
        self.token_ids.extend(new_ids)
        if stopped:
            finish_reason = "stop"
            self.stopped_by_string = True
        if finish_reason is not None and self.finish_reason is None:
            if not stopped:
                detok.flush()  # a trailing partial character, as decode() shows it
            self.finish_reason = finish_reason
        end = len(detok.text) if self.finish_reason else max(self._emitted, len(detok.text) - self._hold)
        delta = detok.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        new_logprobs = list(logprobs or ())[: len(new_ids)]
        self.logprobs.extend(new_logprobs)
        if self.tools is None:
            return ChoiceDelta(delta, new_ids, new_logprobs, self.finish_reason)
        released = self.tools.feed(delta)
        calls = list(released.calls)
        content = released.content
        if self.finish_reason is not None:
            rest = self.tools.finish()
            content += rest.content
            calls += rest.calls
            self.finish_reason = finish_reason_with_tools(self.finish_reason, self.tools)
        self.content += content
        return ChoiceDelta(content, new_ids, new_logprobs, self.finish_reason, calls)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The message's ``tool_calls`` entries (none without tools)."""
        return list(self.tools.tool_calls) if self.tools is not None else []
