"""The sampler draws every non-greedy row of a step in one batch (workers/engine/sampler.py): each
row keeps its own temperature, top-k, min-p and top-p, a seeded row draws exactly what it draws
alone, and rows sharing the engine's generator draw only from their own kept tokens."""

from __future__ import annotations

import torch

from workers.engine.sampler import _draw, _sample_rows, _top_p
from workers.engine.sampling_params import SamplingParams


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One row's token drawn alone."""
    return int(_sample_rows(logits[None], [params], [generator])[0])


VOCAB = 500


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1e-300),  # no distribution left: the raw argmax
]


def test_a_seeded_row_draws_in_a_batch_what_it_draws_alone():
    x = logits(len(MIXED))
    for seed in range(20):
        batch = _sample_rows(x, MIXED, [torch.Generator().manual_seed(seed + i) for i in range(len(MIXED))])
        alone = [sample_row(x[i], p, torch.Generator().manual_seed(seed + i)) for i, p in enumerate(MIXED)]
        assert batch.tolist() == alone


def kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a row may yield, by the transforms' definitions, one row at a time in float64."""
    x = row.double() / p.temperature
    probs = torch.softmax(x, -1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.top_k:
        keep &= x >= torch.topk(x, p.top_k).values[-1]
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    if p.top_p < 1.0:
        masked = probs.masked_fill(~keep, 0.0)
        values, order = masked.sort(descending=True)
        before = values.cumsum(-1) - values
        prefix = set(order[before < p.top_p].tolist())  # the mass min-p left, not renormalized
        keep &= torch.tensor([i in prefix for i in range(VOCAB)])
    return set(torch.nonzero(keep).flatten().tolist())


def test_rows_sharing_a_generator_draw_only_their_own_kept_tokens():
    x = logits(len(MIXED))
    shared = torch.Generator().manual_seed(1)
    seen: list[set[int]] = [set() for _ in MIXED]
    for _ in range(300):
        for i, token in enumerate(_sample_rows(x, MIXED, [shared] * len(MIXED)).tolist()):
            seen[i].add(token)
    for i, p in enumerate(MIXED[:-1]):
        allowed = kept(x[i], p)
        assert seen[i] <= allowed, (p, seen[i] - allowed)
        assert len(seen[i]) > 1 or len(allowed) == 1  # a distribution, not an argmax
    assert seen[1] <= set(torch.topk(x[1], 5).indices.tolist())
    assert seen[-1] == {int(x[-1].argmax())}


def test_a_batch_of_one_kind_and_an_ordinary_draw():
    x = logits(8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)] * 8
    tokens = _sample_rows(x, params, [torch.Generator().manual_seed(3)] * 8)
    assert tokens.shape == (8,) and tokens.dtype == torch.long
    assert len(set(tokens.tolist())) > 1


def test_the_nucleus_found_among_the_top_tokens_is_the_one_a_full_sort_finds():
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    peaked = torch.softmax(torch.randn(3, vocab, generator=gen) * 6, -1)  # nuclei of a few tokens
    flat = torch.softmax(torch.randn(3, vocab, generator=gen) * 0.3, -1)  # nuclei of thousands
    probs = torch.cat([peaked, flat])
    limit = torch.tensor([[0.9], [0.5], [1.0], [0.9], [0.99], [1e-9]])
    got = _top_p(probs, limit)
    for row in range(probs.shape[0]):
        values, order = probs[row].sort(descending=True)
        drop = values.cumsum(-1) - values >= limit[row, 0]
        drop[0] = False
        expected = torch.zeros(vocab).scatter_(-1, order, values.masked_fill(drop, 0.0))
        assert torch.equal(got[row], expected if limit[row, 0] < 1.0 else probs[row]), row
    assert (got[3] > 0).sum() > 256  # the flat rows took the full sort


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]]).repeat(4000, 1)
    tokens = _draw(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).tolist()
    assert counts[0] == counts[2] == counts[5] == 0
    assert abs(counts[1] / 4000 - 0.5) < 0.04 and abs(counts[3] / 4000 - 0.25) < 0.04
