"""The sampler at the edges of what SamplingParams accepts: every accepted value gives a token,
and never an error (an error in sampling stops the engine thread, and every request with it).
Found by tests/integration/test_fuzz_api.py: top_p=5e-324 is 0.0 in fp32, which dropped every
token and made torch.multinomial raise."""

from __future__ import annotations

import pytest
import torch

from workers.engine.sampler import _sample_rows
from workers.engine.sampling_params import SamplingParams


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One row's token drawn alone."""
    return int(_sample_rows(logits[None], [params], [generator])[0])


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=5e-324),  # below fp32's smallest number
        SamplingParams(temperature=1.0, top_p=1e-45),
        SamplingParams(temperature=1e-300),  # logits / temperature overflow to +-inf
        SamplingParams(temperature=1e-300, top_p=0.5, min_p=0.9),
        SamplingParams(temperature=5e-324, top_k=3),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_extreme_accepted_parameters_give_the_most_likely_token(logits, params):
    generator = torch.Generator().manual_seed(1)
    assert sample_row(logits, params, generator) == int(logits.argmax())


def test_ordinary_sampling_is_unchanged(logits):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    draws = {sample_row(logits, params, torch.Generator().manual_seed(s)) for s in range(64)}
    assert len(draws) > 1 and all(0 <= d < 1000 for d in draws)  # still a distribution, not argmax
