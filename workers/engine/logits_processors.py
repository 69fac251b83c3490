"""Sampling controls that rewrite the logits before sampling, with OpenAI's and vLLM's semantics:
``bad_words_ids``, ``min_tokens``, ``logit_bias``, ``repetition_penalty``, ``frequency_penalty``
and ``presence_penalty`` (see ``SamplingParams``).

Each kind is one batched pass of tensor ops over the rows that use it, on the logits' device:
the per-row Python work only turns token-id lists into index tensors, so the cost does not grow
with the vocabulary, and a batch in which no request uses a control pays nothing but a check.
Rows without controls are never written, so their logits stay bit for bit what the model gave.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.engine.sequence import Sequence


class TokenEncoder(Protocol):
    """What ``bad_words_token_ids`` needs of a tokenizer (a Hugging Face tokenizer is one)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(tokenizer: TokenEncoder, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ``bad_words`` forbids, as vLLM derives them: each word as given
    and with one leading space, since a word encodes differently at the start of a text than after
    a space. Duplicates and empty encodings (nothing to forbid) are left out."""
    found: dict[tuple[int, ...], None] = {}  # insertion-ordered set: the output is deterministic
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found[ids] = None
    return tuple(found)


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Apply each row's sampling controls to ``logits`` ([N, V], fp32; row i is ``seqs[i]``), in
    place, and return it. Order as in vLLM: bans (completed bad words; EOS and stop tokens until
    ``min_tokens`` were generated), ``logit_bias``, ``repetition_penalty``, then the frequency and
    presence penalties."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.processes_logits]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    # Built once per row: a property that copies the prompt's tail for a resumed stream.
    generated = {i: seqs[i].generated_token_ids for i in rows}

    ban_rows: list[int] = []
    ban_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    for i in rows:
        params = seqs[i].params
        past = generated[i]
        banned: set[int] = set()
        for word in params.bad_words_ids:
            prefix = len(word) - 1
            # A longer word is banned only where its last token would complete it.
            if prefix == 0 or (len(past) >= prefix and tuple(past[len(past) - prefix :]) == word[:-1]):
                banned.add(word[-1])
        if len(past) < params.min_tokens:
            banned |= seqs[i].eos_token_ids
            banned.update(params.stop_token_ids)
        # Ids outside the vocabulary name no logit (the API rejects them; nothing to ban here).
        cols = [t for t in banned if 0 <= t < vocab]
        ban_rows += [i] * len(cols)
        ban_cols += cols
        # A repeated token keeps its last bias, as in the JSON object the API takes.
        for token, bias in dict(params.logit_bias).items():
            if 0 <= token < vocab:
                bias_rows.append(i)
                bias_cols.append(token)
                bias_values.append(bias)

    if ban_rows:
        cells = (_long(ban_rows, device), _long(ban_cols, device))
        logits.index_put_(cells, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    if bias_rows:
        cells = (_long(bias_rows, device), _long(bias_cols, device))
        values = torch.tensor(bias_values, dtype=logits.dtype, device=device)
        # Each (row, token) occurs once, so accumulating is exactly one addition per logit.
        logits.index_put_(cells, values, accumulate=True)

    rep = [i for i in rows if seqs[i].params.repetition_penalty != 1.0]
    if rep:
        # Prompt and output alike (``prompt_token_ids`` already holds a resumed stream's tail).
        ids = _padded([seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep], vocab, device)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, ids, True)
        penalty = _column([seqs[i].params.repetition_penalty for i in rep], logits.dtype, device)
        index = _long(rep, device)
        sub = logits[index]
        # A penalty above 1 makes a seen token less likely whatever its logit's sign; below 1, more.
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(seen[:, :vocab], penalized, sub)

    freq = [i for i in rows if seqs[i].params.frequency_penalty or seqs[i].params.presence_penalty]
    if freq:
        # Generated tokens only, as OpenAI defines these penalties (the prompt does not count).
        ids = _padded([generated[i] for i in freq], vocab, device)
        counts = torch.zeros(len(freq), vocab + 1, dtype=logits.dtype, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=logits.dtype, device=device))
        counts = counts[:, :vocab]
        frequency = _column([seqs[i].params.frequency_penalty for i in freq], logits.dtype, device)
        presence = _column([seqs[i].params.presence_penalty for i in freq], logits.dtype, device)
        index = _long(freq, device)
        logits[index] = logits[index] - (frequency * counts + presence * (counts > 0).to(logits.dtype))
    return logits


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[R, 1]: one value per row, broadcast over the vocabulary. A tensor, not a Python scalar:
    CUDA turns a division by a scalar into a multiplication by its reciprocal, which rounds
    differently."""
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def _padded(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, longest] token ids, each row padded with ``vocab``: a scatter into a ``vocab + 1``-wide
    buffer sends the padding to a last column that is then dropped. An id outside the vocabulary
    is sent there too, since it has no logit to change."""
    rows = [torch.tensor(ids, dtype=torch.long) for ids in token_lists]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=vocab).to(device)
    return torch.where((ids >= 0) & (ids < vocab), ids, vocab)
