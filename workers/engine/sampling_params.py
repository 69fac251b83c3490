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

    def __post_init__(self) -> None:
        # Accept lists/strings from callers; store tuples so the params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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
        }
        for name, problem in problems.items():
            if problem:
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
