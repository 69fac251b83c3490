"""Per-request sampling parameters, validated at construction (the boundary)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: plus the top N
    # None: none; 0: each prompt token's logprob given its prefix; N: plus the top N at each position.
    # Such a request takes no prefix-cache hit (a cached block holds no logits), as in vLLM.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Output tokens generated before this request began (a decode stream resumed on another
    # replica): seeded sampling draws for position offset + i, so the continuation is identical.
    output_position_offset: int = 0
    # Sampling controls (workers/engine/logits_processors.py), as OpenAI and vLLM define them.
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    frequency_penalty: float = 0.0  # minus this times the token's count among generated tokens
    presence_penalty: float = 0.0  # minus this once the token was generated at all
    repetition_penalty: float = 1.0  # prompt and generated tokens: positive logits / it, negative * it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    # A grammar the output must follow (workers/engine/structured.py): (kind, spec), e.g.
    # ("json_schema", "{...}"), ("regex", "[0-9]+"), ("choice", '["yes", "no"]').
    structured: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Accept lists/strings from callers; store tuples so the params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # Plain data from a message (lists after JSON) becomes tuples: the params stay hashable.
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(int(t) for t in w) for w in self.bad_words_ids))
        if self.structured is not None:
            kind, spec = self.structured
            object.__setattr__(self, "structured", (str(kind), str(spec)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        problems = {
            "max_tokens": self.max_tokens < 1 and "must be at least 1",
            "temperature": not (0.0 <= self.temperature) and "must be >= 0",
            "top_p": not (0.0 < self.top_p <= 1.0) and "must be in (0, 1]",
            "top_k": self.top_k < 0 and "must be -1, 0 (disabled) or positive",
            "min_p": not (0.0 <= self.min_p <= 1.0) and "must be in [0, 1]",
            "logprobs": self.logprobs is not None and self.logprobs < 0 and "must be >= 0",
            "prompt_logprobs": self.prompt_logprobs is not None and self.prompt_logprobs < 0 and "must be >= 0",
            "stop": any(not s for s in self.stop) and "must not contain empty strings",
            "min_tokens": self.min_tokens < 0 and "must be >= 0",
            "frequency_penalty": not (-2.0 <= self.frequency_penalty <= 2.0) and "must be in [-2, 2]",
            "presence_penalty": not (-2.0 <= self.presence_penalty <= 2.0) and "must be in [-2, 2]",
            "repetition_penalty": not self.repetition_penalty > 0.0 and "must be > 0",
            "logit_bias": any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias) and "values must be in [-100, 100]",
            "bad_words_ids": any(not w for w in self.bad_words_ids) and "must not contain empty sequences",
        }
        for name, problem in problems.items():
            if problem:
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")

    @property
    def processes_logits(self) -> bool:
        """Whether any control changes the logits before sampling (besides a grammar)."""
        return bool(
            self.min_tokens
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.bad_words_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
