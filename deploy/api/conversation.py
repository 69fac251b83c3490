"""Conversations that keep their cache: a chat turn that extends an earlier one is tokenized as
that turn's recorded token ids (prompt + generated answer) followed by the new text, so its
block hashes match the KV blocks the workers already hold, answers included.

Recording (after a choice finishes): the answer must be complete and exactly what the model
generated — finished by EOS / a stop token or by length, not cut by a stop string. The ids kept
are the prompt's plus the answer's, less a trailing special stop token that the text does not
show (the chat template writes the end of turn itself). The key is a digest of (model, cache
salt, rendered prompt text + answer text as returned to the client).

Lookup (before tokenizing a chat request): for the latest assistant messages, latest first,
``head = render(messages[:i], add_generation_prompt=True)``; if the request's rendered text is
``head + content + rest`` (or ``head + content.strip() + rest``: templates commonly trim a
message, and the model then sees its answer as it generated it) and ``head + content`` is
recorded, the prompt is ``recorded ids + tokenize(rest)``. Anything else is a miss and the text
is tokenized as usual: a miss costs cache hits, never correctness.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.conversation import ConversationStore, conversation_key

logger = logging.getLogger("pdserve")

MAX_CANDIDATES = 4  # assistant messages tried per request, latest first (each costs a render)


@dataclass(frozen=True, slots=True)
class HistoryCandidate:
    recorded_text: str  # head + content: the text a finished turn was recorded under
    rest_start: int  # where the request's text continues after that turn


@dataclass(frozen=True, slots=True)
class ConversationTurn:
    """What the ingress keeps of a chat request to record its answer once it finishes."""

    prompt_text: str
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class StitchedPrompt:
    token_ids: list[int]
    num_reused_tokens: int  # leading ids taken from a recorded turn


def history_candidates(
    render: Callable[[list[dict]], str], messages: list[dict[str, Any]], text: str, max_candidates: int = MAX_CANDIDATES
) -> list[HistoryCandidate]:
    """Earlier turns ``text`` may extend, latest first (``render`` adds the generation prompt)."""
    found: list[HistoryCandidate] = []
    tried = 0
    for i in range(len(messages) - 1, 0, -1):
        if messages[i]["role"] != "assistant":
            continue
        tried += 1
        if tried > max_candidates:
            break
        try:
            head = render(messages[:i])
        except Exception:  # noqa: BLE001 - a prefix the template refuses is simply no candidate
            continue
        if not text.startswith(head):
            continue
        content = messages[i]["content"]
        for shown in (content, content.strip()):
            if text.startswith(shown, len(head)):
                found.append(HistoryCandidate(head + content, len(head) + len(shown)))
                break
    return found


def answer_token_ids(assembler, special_ids: frozenset[int]) -> list[int] | None:
    """The answer's ids to record after ``assembler``'s choice finished, or None when the
    answer must not be recorded (cut by a stop string, or not finished)."""
    if assembler.finish_reason not in ("stop", "length") or assembler.stopped_by_string:
        return None
    ids = list(assembler.token_ids)
    if assembler.finish_reason == "stop" and ids and ids[-1] in special_ids and assembler.skip_special_tokens:
        ids.pop()  # EOS / end of turn: not in the text; the template writes its own
    return ids


class ConversationCache:
    """Lookups and records of conversation turns for one model, over a ``ConversationStore``."""

    def __init__(
        self, tokenizer, model_key: str, store: ConversationStore, max_candidates: int = MAX_CANDIDATES
    ) -> None:
        self.tokenizer = tokenizer
        self.model_key = model_key
        self.store = store
        self.max_candidates = max_candidates
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.lookups = self.hits = self.reused_tokens = self.recorded = 0

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def prompt_ids(
        self, messages: list[dict[str, Any]], text: str, cache_salt: str | None
    ) -> StitchedPrompt | None:
        """The request's prompt ids continuing a recorded turn, or None (tokenize ``text``)."""
        candidates = history_candidates(self._render, messages, text, self.max_candidates)
        if not candidates:
            return None
        self.lookups += 1
        keys = [conversation_key(self.model_key, cache_salt, c.recorded_text) for c in candidates]
        for candidate, recorded in zip(candidates, await self.store.get_many(keys)):
            if recorded:
                rest = self.tokenizer.encode(text[candidate.rest_start :], add_special_tokens=False)
                self.hits += 1
                self.reused_tokens += len(recorded)
                return StitchedPrompt(recorded + rest, len(recorded))
        return None

    async def remember(self, turn: ConversationTurn, prompt_ids: Sequence[int], assembler) -> bool:
        """Record a finished choice's turn; False when it is not recordable or not kept."""
        answer = answer_token_ids(assembler, self.special_ids)
        if answer is None:
            return False
        key = conversation_key(self.model_key, turn.cache_salt, turn.prompt_text + assembler.text)
        kept = await self.store.put(key, [*prompt_ids, *answer])
        self.recorded += kept
        return kept

    def stats(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "reused_tokens": self.reused_tokens,
            "recorded": self.recorded,
        }
