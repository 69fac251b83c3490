"""The CUDA paged decode kernel (workers/backends/cuda/triton_paged.py) against the inductor kernel's
definition (``_paged_decode``) in float64: GQA, ragged rows, sliding windows, split counts, and a
cache whose unwritten slots and padding block hold NaN. Runs on CUDA, or on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU; the test extra installs triton;
its ``tl.dot`` mishandles bf16 there, so bf16 is checked on CUDA only)."""

from __future__ import annotations

import pytest
import torch

from workers.backends.cuda import triton_paged
from workers.layers.paged_attention import _paged_decode

ON_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not triton_paged.available(), reason="needs triton (the test extra installs it)")
DEVICE = "cuda" if ON_CUDA else "cpu"


def poisoned_case(batch, hq, hkv, head_dim, block_size, num_blocks, dtype, window, seed):
    """Random cache, q and ragged tables; every slot no row may read holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    lens = torch.randint(1, 12 * block_size, (batch,), generator=gen)
    firsts = torch.zeros(batch, dtype=torch.long)
    if window:
        firsts = (torch.clamp(lens - window, min=0) // block_size) * block_size
    counts = (lens + block_size - 1) // block_size - firsts // block_size
    tables = torch.zeros(batch, int(counts.max()), dtype=torch.long)  # padding: block 0
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for b in range(batch):
        n = int(counts[b])
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
        filled = int(lens[b] - firsts[b] - (n - 1) * block_size)
        k[tables[b, n - 1], filled:] = float("nan")
        v[tables[b, n - 1], filled:] = float("nan")
    k[0] = v[0] = float("nan")
    q = torch.randn(batch, hq, head_dim, generator=gen)
    scale = head_dim**-0.5
    ref = _paged_decode(q.double(), k.double(), v.double(), tables, firsts, lens, scale, window)
    on = [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), tables, firsts, lens)]
    return on, scale, ref


CASES = {
    "gqa": dict(batch=3, hq=8, hkv=2, head_dim=16, block_size=16, num_blocks=64, window=None),
    "mha-window": dict(batch=4, hq=4, hkv=4, head_dim=32, block_size=16, num_blocks=80, window=40),
    "one-kv-head": dict(batch=5, hq=6, hkv=1, head_dim=16, block_size=16, num_blocks=128, window=None),
    "block-32": dict(batch=2, hq=8, hkv=2, head_dim=16, block_size=32, num_blocks=64, window=None),
}


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference_and_ignores_unwritten_slots(name, splits):
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
    for seed, dtype in enumerate(dtypes):
        (q, k, v, tables, firsts, lens), scale, ref = poisoned_case(**CASES[name], dtype=dtype, seed=seed)
        out = triton_paged.paged_decode(q, k, v, tables, firsts, lens, scale, CASES[name]["window"], splits)
        assert out.shape == q.shape and out.dtype == dtype
        assert not torch.isnan(out).any()
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, err)


def test_split_count_fills_the_gpu_without_empty_splits():
    assert triton_paged.num_splits_for(batch=1, num_kv_heads=8, num_blocks_per_row=128, blocks_per_tile=4) == 32
    assert triton_paged.num_splits_for(batch=64, num_kv_heads=8, num_blocks_per_row=128, blocks_per_tile=4) == 1
    assert triton_paged.num_splits_for(batch=1, num_kv_heads=8, num_blocks_per_row=3, blocks_per_tile=4) == 1
