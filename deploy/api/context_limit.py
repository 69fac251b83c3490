"""The context a request may use: the deployment's ``max_model_len``, or the request's own
``max_model_len`` when it asks for less (a per-session cap on a conversation's growth)."""

from __future__ import annotations

from collections.abc import Sequence

from deploy.api.openai_protocol import RequestError


def fit_to_context(
    prompt_ids: Sequence[int],
    max_tokens: int | None,
    vocab_size: int,
    model_limit: int,
    request_limit: int | None = None,
) -> int:
    """Check the prompt against the vocabulary and the context limit; return the tokens the
    completion may have (``max_tokens``, or all the room left when it is None)."""
    if not prompt_ids:
        raise RequestError("prompt is empty", "prompt")
    if any(t >= vocab_size for t in prompt_ids):
        raise RequestError(f"prompt has token ids outside the vocabulary [0, {vocab_size})", "prompt")
    if request_limit is not None and request_limit > model_limit:
        raise RequestError(
            f"max_model_len {request_limit} exceeds this model's maximum context length of {model_limit} "
            f"tokens: ask for at most {model_limit}, or leave max_model_len out.",
            "max_model_len",
        )
    limit = request_limit or model_limit
    whose = (
        f"This request's max_model_len is {limit} tokens"
        if request_limit is not None
        else f"This model's maximum context length is {limit} tokens"
    )
    room = limit - len(prompt_ids)
    if room < 1:
        raise RequestError(
            f"{whose}; the prompt has {len(prompt_ids)} tokens. Shorten the prompt.",
            "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise RequestError(
            f"{whose}. However, you requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in "
            f"the prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
