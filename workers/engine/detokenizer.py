"""Incremental detokenization that never emits half a character.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a prefix gives
U+FFFD. Text is emitted only up to a point where decoding is stable: a short window of tokens
before the read offset is re-decoded each step, and nothing is emitted while the window's
decoding ends in U+FFFD. Stop strings are matched on the emitted text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, cast

_WINDOW = 6  # tokens of left context re-decoded with each new token (handles merges at the seam)


class TokenDecoder(Protocol):
    """What detokenizing needs of a tokenizer (a Hugging Face tokenizer is one). A flat list of
    ids decodes to one string; Hugging Face's type names every form ``decode`` can return."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: TokenDecoder
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        # Seed the window with the prompt's tail so the first output token decodes in context
        # (a leading-space token after a prompt renders as a space, not stripped).
        # A prompt that ends inside a character (its tail decodes to U+FFFD) is left out: output
        # bytes completing that character would otherwise render the whole character in context
        # and its replacement would vanish from the output text, which then differs from the
        # output ids' own decoding ("\ufffdable" decoded alone, "able" after "...\xdb").
        tail = self.prompt_token_ids[-_WINDOW:]
        if tail and self._decode(tail).endswith("\ufffd"):
            tail = []
        self._ids = list(tail)
        self._prefix_offset = 0
        self._read_offset = len(tail)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # mid-character (or nothing visible yet): wait for more bytes
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # tokens before the prefix offset are never decoded again: keep the list short
        if self._prefix_offset > _WINDOW * 4:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))

    def flush(self) -> str:
        """At the end of a sequence, emit whatever is pending (a dangling partial character)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


def find_stop_cut(text: str, num_new_chars: int, stops: tuple[str, ...], include_stop: bool) -> int | None:
    """Where to cut ``text`` if a stop string ends in its last ``num_new_chars`` characters.

    A stop string may straddle the old text and the new piece, so the search starts
    ``len(stop) - 1`` characters before the new piece. Returns None when no stop string occurs.
    """
    if not stops or not num_new_chars:
        return None
    start = max(0, len(text) - num_new_chars - max(map(len, stops)) + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    if not hits:
        return None
    index, stop = min(hits)
    return index + len(stop) if include_stop else index
