"""Paged decode attention on CPU as one hand-written C++ kernel (split-K, online softmax).

``paged_decode(q, k_cache, v_cache, tables, first_pos, context_lens, scale, window)`` computes
what ``paged_attention._paged_decode`` does (one query per row over the blocks of its table,
causal and within the sliding window, GQA) for an fp32 or bf16 cache (bf16 read as it is stored
and summed in fp32, the output rounded once), without a gathered copy. The
inductor kernel that ``_paged_decode`` becomes on CPU read the cache at ~10 GB/s with the cache
cold (SmolLM2's shapes, 8 rows x 320 keys, 30 layers: 11.9 ms a step; BENCHMARKS.md, "The CPU
paged-attention kernel"): it makes three passes over the keys (scores, max and sum, output),
recomputes each exponential in the last, and reads each V row once per query head and per 16 of
its 64 columns. Here one task holds every query head of one row (q, and its running
output, in local arrays) and walks a range of the row's blocks once, each block front to back: it
scores the block's keys for every head, takes their exponentials as vectors (Sleef, through
``at::vec``; ``BS`` scores per head, one AVX-512 vector with 16-key blocks), rescales a head's
running sums only when the block raises its maximum (online softmax), and adds the block's V
rows weighted by them; each K and V row is read once, and the next block is prefetched while
this one runs (the table's blocks lie anywhere in the cache). A row's blocks are split over
tasks when the batch has fewer rows than ``TASKS_PER_THREAD`` x threads, and the splits'
partial results are combined at the end (flash decoding). Same shapes: 7.7 ms a step.

The source, ``csrc/paged.cpp``, is compiled once per (block size, KV heads, group, head dim)
through ``build.py`` (the compiler flags, OpenMP and vector ISA that inductor used for it, and
one on-disk cache), so it needs what the ``paged`` backend needed already: a C++ compiler. When
it cannot be built the backend keeps the inductor kernel (``available`` says which).

A key counts when its position is at most the query's (the row's context length - 1) and, with a
window, less than ``window`` before it. Positions grow along a table, so the walk stops at the
first block that starts past the query; whatever an unread or masked slot holds cannot reach the
output (its weight is exactly 0 and its V row is never loaded).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.backends.cpu import build as loader

TASKS_PER_THREAD = 4  # split a row's blocks until there are this many tasks per thread


DTYPES = (torch.float32, torch.bfloat16)  # a bf16 cache is read as bf16 and summed in fp32


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: fp32 or bf16 (q and cache alike) on CPU, a head dim of
    whole vectors (16 floats covers AVX2's 8 and AVX-512's 16), contiguous cache rows."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_cache.dtype == q.dtype
        and q.shape[-1] % 16 == 0
        and k_cache.is_contiguous()
    )


@functools.cache
def _kernel(block_size: int, num_kv_heads: int, group: int, head_dim: int, bf16: int = 0) -> Any:
    """The compiled kernel (``csrc/paged.cpp``) for one cache shape and dtype (``build.py`` keeps it on disk)."""
    return loader.kernel(
        "paged", block_size=block_size, kv_heads=num_kv_heads, group=group, head_dim=head_dim, bf16=bf16
    )


@functools.cache
def available(block_size: int, num_kv_heads: int, group: int, head_dim: int, bf16: int = 0) -> bool:
    """Whether the kernel builds for this shape and dtype here (asked once each; a failure is
    logged and the caller keeps the inductor kernel)."""
    return loader.usable("paged", block_size, num_kv_heads, group, head_dim, bf16)


# build.py's registry; ``warm``: SmolLM2's cache shape (16-slot blocks, 3 KV heads of 64, 9 query
# heads), fp32 and bf16
loader.register(
    "paged",
    loader.SelfCheck(
        "CPU paged-attention",
        "inductor's kernel",
        lambda *shape: _kernel(*shape),
        warm=((16, 3, 3, 64, 0), (16, 3, 3, 64, 1)),
    ),
)


def num_splits_for(batch: int, num_blocks: int, threads: int) -> int:
    """Splits of a row's blocks: enough tasks for ``TASKS_PER_THREAD`` per thread, at least two
    blocks a split."""
    want = -(-TASKS_PER_THREAD * threads // batch)
    return max(1, min(want, num_blocks // 2))


def splits_for(batch: int, num_blocks: int, threads: int, num_splits: int | None = None) -> int:
    """The splits the kernel runs: ``num_splits`` (default ``num_splits_for``), within 1..blocks."""
    return max(1, min(num_splits or num_splits_for(batch, num_blocks, threads), num_blocks))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    first_pos: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q ``[B, Hq, D]``; k/v_cache ``[N, bs, Hkv, D]``; tables ``[B, M]`` int64; first_pos and
    context_lens ``[B]`` int64. Returns ``[B, Hq, D]`` in q's dtype (see the module docstring)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    kernel = _kernel(block_size, num_kv_heads, group, head_dim, int(q.dtype == torch.bfloat16))
    q = q.contiguous()
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    first_pos, context_lens = first_pos.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    threads = torch.get_num_threads()
    blocks = tables.shape[1]
    kernel(
        q,
        k_cache,
        v_cache,
        tables,
        first_pos,
        context_lens,
        out,
        batch,
        blocks,
        tables.stride(0),
        window or 0,
        splits_for(batch, blocks, threads, num_splits),
        threads,
        float(scale),
    )
    return out
