"""The CPU paged decode kernel (``workers/backends/cpu/paged.py``) against attention written out
in float64 over the same keys: block sizes, GQA groups, head dims, sliding windows, tables that
start past position 0, any number of splits; slots it must not read hold NaN."""

from __future__ import annotations

import math

import pytest
import torch

from workers.backends.cpu import paged as cpu_paged


def reference(q, k_cache, v_cache, tables, first_pos, lens, scale, window):
    """softmax(q k^T) v per row over the keys its table holds that it may see, in float64."""
    batch, hq, _ = q.shape
    _, bs, hkv, _ = k_cache.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        query = int(lens[b]) - 1
        keys, values = [], []
        for i, block in enumerate(tables[b].tolist()):
            for r in range(bs):
                pos = int(first_pos[b]) + i * bs + r
                if pos <= query and (window is None or query - pos < window):
                    keys.append(k_cache[block, r])
                    values.append(v_cache[block, r])
        if not keys:
            continue
        k = torch.stack(keys).double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = torch.stack(values).double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double() * scale, k)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def case(bs, hkv, group, dim, lens, first_pos=None, blocks=64, seed=0):
    """A cache whose every slot outside the rows' visible keys holds NaN, and tables of distinct
    random blocks wide enough for the longest row (shorter rows padded with block 0)."""
    gen = torch.Generator().manual_seed(seed)
    first_pos = first_pos or [0] * len(lens)
    k_cache = torch.full((blocks, bs, hkv, dim), math.nan)
    v_cache = torch.full((blocks, bs, hkv, dim), math.nan)
    widths = [math.ceil((n - f) / bs) for n, f in zip(lens, first_pos)]
    ids = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.long)
    for b, (n, f, width) in enumerate(zip(lens, first_pos, widths)):
        for i in range(width):
            block = ids.pop()
            tables[b, i] = block
            rows = min(bs, n - f - i * bs)  # written slots of this block
            k_cache[block, :rows] = torch.randn(rows, hkv, dim, generator=gen)
            v_cache[block, :rows] = torch.randn(rows, hkv, dim, generator=gen)
    q = torch.randn(len(lens), hkv * group, dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(first_pos), torch.tensor(lens)


@pytest.mark.parametrize(
    ("bs", "hkv", "group", "dim"),
    [(16, 3, 3, 64), (16, 2, 2, 16), (8, 1, 4, 32), (32, 4, 1, 128)],
    ids=["smollm2", "tiny", "bs8-mqa", "bs32-mha-d128"],
)
@pytest.mark.parametrize("splits", [None, 1, 2, 5])
def test_matches_attention_written_out(bs, hkv, group, dim, splits):
    lens = [1, 5, bs, bs + 1, 3 * bs + 7, 70]
    q, k, v, tables, first, n = case(bs, hkv, group, dim, lens)
    got = cpu_paged.paged_decode(q, k, v, tables, first, n, dim**-0.5, None, num_splits=splits)
    want = reference(q, k, v, tables, first, n, dim**-0.5, None)
    assert torch.isfinite(got).all(), "a NaN slot it must not read reached the output"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_sliding_window_and_tables_that_start_late(splits):
    """A 20-key window; the rows' tables start at blocks past position 0 (earlier blocks freed),
    and a block wholly before a row's window is skipped, not read (it holds NaN for the row)."""
    bs, window = 16, 20
    lens, first_pos = [40, 75, 33, 100], [0, 48, 16, 64]
    q, k, v, tables, first, n = case(bs, 2, 2, 32, lens, first_pos)
    stale = int(tables[0, 0])  # row 0's first block: keys 0..15, all before its window (19..39)
    k[stale], v[stale] = math.nan, math.nan
    got = cpu_paged.paged_decode(q, k, v, tables, first, n, 0.3, window, num_splits=splits)
    want = reference(q, k, v, tables, first, n, 0.3, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_threads_and_empty_batch():
    """The same output on one thread as on two (the split follows the thread count), and an
    empty batch returns an empty output."""
    q, k, v, tables, first, n = case(16, 3, 3, 64, [300, 17, 64])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_paged.paged_decode(q, k, v, tables, first, n, 0.125, None)
        torch.set_num_threads(2)
        two = cpu_paged.paged_decode(q, k, v, tables, first, n, 0.125, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)
    empty = cpu_paged.paged_decode(q[:0], k, v, tables[:0], first[:0], n[:0], 0.125, None)
    assert empty.shape == (0, 9, 64)


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_bf16_matches_attention_written_out_over_the_same_bf16_values(splits):
    """A bf16 cache and queries: the kernel reads them as stored, sums in fp32 and rounds the output
    once, so it stays within one bf16 rounding of float64 attention over the same bf16 values."""
    lens = [1, 17, 70, 33]
    q, k, v, tables, first, n = case(16, 3, 3, 64, lens, seed=5)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = cpu_paged.paged_decode(q, k, v, tables, first, n, 0.125, None, num_splits=splits)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    want = reference(q.double(), k.double(), v.double(), tables, first, n, 0.125, None)
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=8e-3)
    window = cpu_paged.paged_decode(q, k, v, tables, first, n, 0.125, 20, num_splits=splits)
    torch.testing.assert_close(
        window.double(),
        reference(q.double(), k.double(), v.double(), tables, first, n, 0.125, 20),
        rtol=8e-3,
        atol=8e-3,
    )


def test_supports_only_cpu_fp32_or_bf16_whole_vectors():
    k = torch.zeros(4, 16, 2, 64)
    assert cpu_paged.supports(torch.zeros(1, 4, 64), k)
    assert cpu_paged.supports(torch.zeros(1, 4, 64, dtype=torch.bfloat16), k.bfloat16())
    assert not cpu_paged.supports(torch.zeros(1, 4, 64, dtype=torch.bfloat16), k)  # q and cache alike
    assert not cpu_paged.supports(torch.zeros(1, 4, 64, dtype=torch.float16), k.half())
    assert not cpu_paged.supports(torch.zeros(1, 4, 24), torch.zeros(4, 16, 2, 24))
    assert not cpu_paged.supports(torch.zeros(1, 4, 64), k.transpose(0, 1))


def test_split_count():
    """Enough tasks for every thread (TASKS_PER_THREAD each), never a split of under two blocks."""
    assert cpu_paged.num_splits_for(batch=1, num_blocks=20, threads=2) == 2 * cpu_paged.TASKS_PER_THREAD
    assert cpu_paged.num_splits_for(batch=8, num_blocks=20, threads=2) == 1
    assert cpu_paged.num_splits_for(batch=1, num_blocks=3, threads=2) == 1
    assert cpu_paged.num_splits_for(batch=3, num_blocks=40, threads=2) == 3
