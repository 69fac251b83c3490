"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs, and
prompt logprobs.

Logprobs are those of the model's distribution (log-softmax of the raw logits), as vLLM and
OpenAI report them, whatever the sampling transforms did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence, TokenLogprob


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).cpu()


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    argmax: Callable[[torch.Tensor], torch.Tensor] = _argmax,
    raw_logits: torch.Tensor | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits`` ([N, V], fp32) for the matching sequence; ``argmax``: the
    backend's (each row's first maximal index, on the CPU). ``raw_logits``: the model's before
    penalties and grammars changed ``logits``, which logprobs report (default: ``logits``)."""
    tokens = torch.empty(len(seqs), dtype=torch.long)
    greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
    if len(greedy_rows) == len(seqs):
        tokens = argmax(logits)
    elif greedy_rows:
        rows = torch.tensor(greedy_rows)
        tokens[rows] = logits[rows.to(logits.device)].argmax(dim=-1).cpu()
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            if seq.params.seed is not None:
                # A pure function of (seed, output position): the same tokens whichever worker
                # samples them, after a preemption, or when prefill and decode are split.
                position = seq.params.output_position_offset + seq.num_output_tokens
                assert seq.generator is not None, "add_request gives a seeded sequence its own generator"
                seq.generator.manual_seed(_position_seed(seq.params.seed, position))
            tokens[i] = _sample_row(logits[i], seq.params, seq.generator)
    token_list = tokens.tolist()

    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        source = logits if raw_logits is None else raw_logits
        log_probs = torch.log_softmax(source[torch.tensor(want, device=source.device)], dim=-1).cpu()
        for row, i in enumerate(want):
            n = seqs[i].params.logprobs
            top: tuple[tuple[int, float], ...] = ()
            if n:
                values, ids = log_probs[row].topk(n)
                top = tuple(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(token_list[i], log_probs[row, token_list[i]].item(), top)
    return token_list, logprobs


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """Row i of ``logits`` ([n, V]) scores prompt token ``targets[i]``: its logprob, plus the
    ``top`` most likely tokens at that position (best first)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=log_probs.device)
    chosen = log_probs.gather(1, index[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, ids = log_probs.topk(top, dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(targets, chosen, ids.tolist(), values.tolist())
    ]


def _position_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2**63)


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    raw = logits
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs >= params.top_p
        drop[..., 0] = False  # also when top_p is below the dtype's smallest number (5e-324 is 0.0 in fp32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        # Extreme parameters (a temperature so small the logits overflow) leave no distribution:
        # the limit they approach is greedy, and a request must never stop the engine.
        return int(torch.argmax(raw).item())
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())
