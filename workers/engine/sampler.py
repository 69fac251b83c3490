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
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        generators = []
        for i in random_rows:
            seq = seqs[i]
            if seq.params.seed is not None:
                # A pure function of (seed, output position): the same tokens whichever worker
                # samples them, after a preemption, or when prefill and decode are split.
                position = seq.params.output_position_offset + seq.num_output_tokens
                assert seq.generator is not None, "add_request gives a seeded sequence its own generator"
                seq.generator.manual_seed(_position_seed(seq.params.seed, position))
            generators.append(seq.generator)
        index = torch.tensor(random_rows)
        drawn = _sample_rows(logits[index.to(logits.device)], [seqs[i].params for i in random_rows], generators)
        tokens[index] = drawn.cpu()
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


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, V]`` under its own temperature, top-k, min-p and
    top-p, drawn with its own generator (rows that share one draw together): int64 ``[N]`` on the
    logits' device. The transforms run on the whole batch, and the host reads one flag a step (is
    there a row without a distribution), not a few values per row."""
    n, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    x = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=device)
        top = torch.topk(x, max(top_k), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    top_p = [p.top_p for p in params]
    if any(t < 1.0 for t in top_p):
        probs = _top_p(probs, torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None])
    # Extreme parameters (a temperature so small the logits overflow) leave no distribution: the
    # limit they approach is greedy, and a request must never stop the engine. Such a row (its
    # mass NaN or zero) becomes all its mass on the raw argmax, so the draw below picks it.
    broken = ~(probs.sum(dim=-1) > 0)
    if bool(broken.any()):
        hit = torch.nonzero(broken).flatten()
        probs[hit] = torch.zeros_like(probs[hit]).scatter_(-1, logits[hit].argmax(-1, keepdim=True), 1.0)
    out = torch.empty(n, dtype=torch.long, device=device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    for generator, rows in groups.values():
        picked = probs[torch.tensor(rows, device=device)] if len(rows) < n else probs
        out[torch.tensor(rows, device=device)] = _draw(picked, generator).to(device)
    return out


def _top_p(probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``probs`` ``[N, V]`` with each row's tokens outside its nucleus zeroed: the smallest set of
    most likely tokens whose mass reaches the row's ``limit`` (``[N, 1]``; the first token always
    stays, and a row at 1.0 keeps every token). A nucleus almost always lies among a row's few
    hundred most likely tokens: those are found with ``topk`` and the whole vocabulary is sorted
    only for the rows whose nucleus reaches past them (a full sort costs ms a row on a CPU)."""
    vocab = probs.shape[-1]
    out = probs.clone()
    rows = torch.nonzero(limit[:, 0] < 1.0).flatten()
    for k in (min(256, vocab), vocab):
        if rows.numel() == 0:
            break
        values, order = probs[rows].topk(k, dim=-1, sorted=True) if k < vocab else probs[rows].sort(-1, True)
        cumulative = values.cumsum(-1)
        # a token stays while the mass before it is short of the limit (the first always stays:
        # also when top_p is below the dtype's smallest number, 5e-324 being 0.0 in fp32)
        drop = cumulative - values >= limit[rows]
        drop[:, 0] = False
        done = (cumulative[:, -1] >= limit[rows, 0]) | (k == vocab)
        kept = torch.zeros_like(out[rows]).scatter_(-1, order, values.masked_fill(drop, 0.0))
        out[rows[done]] = kept[done]
        rows = rows[~done]
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` (non-negative, each row with mass) by inverse CDF: one
    uniform a row from ``generator``, found in the row's cumulative sums. ``torch.multinomial``
    draws the same way but costs about a millisecond a row of a large vocabulary on a CPU. The
    point is kept below the row's total (rounding could put it there), so the first sum past it
    belongs to a token with mass."""
    device = generator.device if generator is not None else probs.device
    cdf = probs.to(device).cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=device, dtype=cdf.dtype)
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]
