"""Structured outputs: a grammar the generated tokens must follow, enforced by masking the
logits before sampling (XGrammar underneath, as in vLLM and SGLang).

A request names its grammar as ``SamplingParams.structured = (kind, spec)`` (``KINDS``). The
engine compiles it once per process (XGrammar's compiler caches by spec), gives the sequence a
matcher, and each step fills one bitmask for every constrained row of the batch and applies it
in one pass. The matcher's state is a function of the tokens generated so far, so it is rebuilt
from them wherever the request continues — a decode worker after prefill sampled the first
token, a stream resumed on another replica — and nothing but token ids crosses a process.

``check_spec`` parses a spec without a tokenizer: the ingress calls it to refuse a grammar that
cannot compile before any worker sees it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.backends.base import Ops
    from workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# The kinds a constraint may take, with what its spec is:
KINDS = {
    "json_object": "any JSON object (spec ignored)",
    "json_schema": "a JSON schema, as a JSON string",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON list of strings: the output is one of them",
    "grammar": "an EBNF grammar (GBNF / XGrammar syntax) with a root rule",
    "structural_tag": "XGrammar's structural tag, as a JSON string",
}


class GrammarError(ValueError):
    """A spec that cannot become a grammar; the message says why, without XGrammar's source
    position prefix."""


def _xgr():
    import xgrammar  # a heavy import: only processes that serve structured outputs pay it

    return xgrammar


def _clean(exc: BaseException) -> str:
    # XGrammar's messages start "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())


def _choice_regex(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice must be a JSON list of strings: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _grammar(kind: str, spec: str):
    """The spec as an XGrammar ``Grammar`` (no tokenizer needed); GrammarError if it is not one."""
    xgr = _xgr()
    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; one of {sorted(KINDS)}")
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_regex(_choice_regex(spec))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        return xgr.Grammar.from_structural_tag(spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - XGrammar raises RuntimeError/ValueError/its own types
        raise GrammarError(_clean(exc)) from exc


def check_spec(kind: str, spec: str) -> None:
    """Raise GrammarError when ``(kind, spec)`` is not a grammar XGrammar can build."""
    _grammar(kind, spec)


class GrammarMatcherError(RuntimeError):
    """A token the grammar does not allow reached a matcher (a replayed history that does not
    follow it)."""


class StructuredOutputs:
    """One engine's grammars: the compiler (and its cache), a matcher per constrained sequence,
    and the batched mask. Compiling is thread-safe: workers compile a request's grammar off the
    engine thread before adding it (``compile``), so the step loop only finds it cached."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        # The mask fill shares the step's cores with the model: a thread per four rows at most,
        # and a lone row filled on this thread (handing one row to a pool costs more than it).
        self.batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(threads // 2, 4)))
        # Special tokens other than the stops are text to a grammar (``<|im_start|>`` is a valid
        # JSON string), but the detokenizer drops them from the text: the two would disagree.
        self.banned = sorted(set(tokenizer.all_special_ids) - set(stop_token_ids))
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    def compile(self, structured: tuple[str, str]):
        """The compiled grammar for ``structured`` (cached); GrammarError if it is not one."""
        found = self._compiled.get(structured)
        if found is not None:
            return found
        compiled = self.compiler.compile_grammar(_grammar(*structured))
        with self._lock:
            if len(self._compiled) >= 1024:  # distinct specs a process keeps; XGrammar caches too
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[structured] = compiled
        return compiled

    def matcher(self, structured: tuple[str, str], history: Seq[int] = ()):
        """A matcher for a new sequence, advanced over ``history`` (tokens already generated:
        the first token sampled by a prefill worker, a resumed stream's earlier tokens)."""
        matcher = _xgr().GrammarMatcher(self.compile(structured))
        for position, token in enumerate(history):
            if not matcher.accept_token(token):
                raise GrammarMatcherError(
                    f"generated token {token} at output position {position} does not follow the grammar"
                )
        return matcher

    def apply(self, logits: torch.Tensor, seqs: Seq[Sequence], ops: Ops) -> None:
        """Mask, in place, every token a row's grammar does not allow next (rows without one
        are untouched); ``ops``: the backend's, which applies the bitmask."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        n = len(seqs)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = _xgr().allocate_token_bitmask(max(n, 8), self.vocab_size)
        bitmask = self._bitmask[:n]
        if len(rows) == 1:
            seqs[rows[0]].grammar.fill_next_token_bitmask(bitmask, rows[0])
        else:
            self.batch.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], bitmask, rows)
        ops.apply_token_bitmask(logits, bitmask, rows, self.vocab_size)
        if self.banned:
            index = torch.tensor(rows, device=logits.device)[:, None]
            logits[index, torch.tensor(self.banned, device=logits.device)] = float("-inf")

    @staticmethod
    def accept(seq: Sequence, token: int) -> bool:
        """Advance ``seq``'s matcher over its new token; True when the grammar is complete
        (nothing more may follow: the sequence stops)."""
        matcher = seq.grammar
        if not matcher.accept_token(token):
            raise GrammarMatcherError(f"request {seq.request_id}: sampled token {token} breaks its grammar")
        return bool(matcher.is_terminated())
