"""Paged decode attention on CUDA as one hand-written Triton kernel (split-K, "flash decoding").

``paged_decode(q, k_cache, v_cache, tables, first_pos, context_lens, scale, window)`` computes
what ``paged_attention._paged_decode`` does (one query per row over the blocks of its table,
causal and within the sliding window, GQA) without a gathered copy. The inductor kernel that
``_paged_decode`` becomes on CUDA is far slower than gather + SDPA at wide batches: its loops
are reductions over one key at a time. Here each program holds the G query heads of one KV head as
a tile padded to 16 rows, and multiplies it with ``BLOCK_N`` keys at a time on the tensor cores
(``tl.dot``; fp32 caches in IEEE precision, not TF32), keeping a running max and sum (online
softmax) in fp32. The keys of a row are split over ``num_splits`` programs so that a small batch
still fills the GPU; a second kernel combines the splits' partial results (a row of one
split is normalised and written by the first).

It is right in fp32/fp16/bf16 and, with the combine as a kernel, level with gather + SDPA (eager
and compiled), not faster: ``auto`` keeps SDPA on CUDA
(docs/decisions/0002-decode-on-cuda-defaults-to-sdpa.md).

Each key tile spans ``BLOCK_N // block_size`` cache blocks, whose ids come from the row's table:
K and V are read where they lie, each once. A key counts when its table slot is in range, its
position is at most the query's (the row's context length - 1) and, with a window, less than
``window`` before it; every other slot is masked before the softmax and its V load is masked
too, so whatever an unwritten slot holds (NaN included) cannot reach the output.

Triton is imported on first use: CUDA builds of torch bring it; without it the paged backend
keeps the inductor kernel. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (numpy), which
is how the tests check it on a machine without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.backends.cuda import triton_available

G_TILE = 16  # query heads per program, padded: tl.dot needs 16 rows
TARGET_PROGRAMS = 2 * 132  # twice an H100/H200's multiprocessors: enough splits to fill one


available = triton_available  # asked before the kernels are built


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """(the split kernel, the combine kernel), compiled by Triton on first call."""
    import triton
    import triton.language as tl

    # Sizes that vary between steps, and the step's small metadata tensors (which may be views
    # at any offset), are not specialised on: one compile per model shape, at start-up.
    @triton.jit(
        do_not_specialize=[
            "tables_ptr",
            "first_pos_ptr",
            "lens_ptr",
            "num_blocks_per_row",
            "blocks_per_split",
            "window",
            "stride_tb",
        ]
    )
    def _split_kernel(
        q_ptr,  # [B, Hq, D]
        k_ptr,  # [N, bs, Hkv, D]
        v_ptr,
        tables_ptr,  # [B, M] int
        first_pos_ptr,  # [B] int
        lens_ptr,  # [B] int
        out_ptr,  # [B, Hq, D] in q's dtype: written here when a row's keys are one split
        acc_ptr,  # [B, Hkv, S, G_TILE, D] fp32: else each split's partial result
        max_ptr,  # [B, Hkv, S, G_TILE] fp32
        sum_ptr,  # [B, Hkv, S, G_TILE] fp32
        scale,
        num_blocks_per_row,  # M
        blocks_per_split,
        window,  # keys at q - window < k <= q; 0: no window
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_vn,
        stride_vt,
        stride_vh,
        stride_tb,
        GROUP: tl.constexpr,  # query heads per KV head
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_N: tl.constexpr,  # keys per tile (a multiple of BLOCK_SIZE)
        HEAD_DIM: tl.constexpr,
        G_PAD: tl.constexpr,
        IEEE: tl.constexpr,  # fp32 cache: exact products, not TF32
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)

        q_rows = kv_head * GROUP + g
        q = tl.load(
            q_ptr + row * stride_qb + q_rows[:, None] * stride_qh + d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )
        query_pos = tl.load(lens_ptr + row) - 1
        first = tl.load(first_pos_ptr + row)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)

        block_lo = split * blocks_per_split
        block_hi = tl.minimum(block_lo + blocks_per_split, num_blocks_per_row)
        for start in range(block_lo * BLOCK_SIZE, block_hi * BLOCK_SIZE, BLOCK_N):
            slot = start + n  # key index within the row's table
            table_idx = slot // BLOCK_SIZE
            in_table = table_idx < block_hi
            block = tl.load(tables_ptr + row * stride_tb + table_idx, mask=in_table, other=0).to(tl.int64)
            key_pos = first + slot
            seen = in_table & (key_pos <= query_pos)
            if window > 0:
                seen = seen & (query_pos - key_pos < window)
            within = slot % BLOCK_SIZE
            k = tl.load(
                k_ptr + block[:, None] * stride_kn + within[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=seen[:, None],
                other=0.0,
            )
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(seen[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(
                v_ptr + block[:, None] * stride_vn + within[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                mask=seen[:, None],
                other=0.0,
            )
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        if tl.num_programs(2) == 1:  # the whole row: normalise and write the output
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + row * stride_qb + q_rows[:, None] * stride_qh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=(g < GROUP)[:, None],
            )
        else:
            part = (row * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
            tl.store(acc_ptr + part * G_PAD * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :], acc)
            tl.store(max_ptr + part * G_PAD + g, m_i)
            tl.store(sum_ptr + part * G_PAD + g, l_i)

    @triton.jit(do_not_specialize=["num_splits"])
    def _combine_kernel(
        out_ptr,  # [B, Hq, D]
        acc_ptr,
        max_ptr,
        sum_ptr,
        num_splits,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        G_PAD: tl.constexpr,
    ):
        """Each split holds an unnormalised sum under its own running max: rescale to one max."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        first = (row * tl.num_programs(1) + kv_head) * num_splits
        m_all = tl.full([G_PAD], float("-inf"), tl.float32)
        for s in range(0, num_splits):
            m_all = tl.maximum(m_all, tl.load(max_ptr + (first + s) * G_PAD + g))
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
        for s in range(0, num_splits):
            part = first + s
            w = tl.exp(tl.load(max_ptr + part * G_PAD + g) - m_safe)
            total += w * tl.load(sum_ptr + part * G_PAD + g)
            acc += w[:, None] * tl.load(acc_ptr + part * G_PAD * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :])
        out = acc / total[:, None]
        tl.store(
            out_ptr + row * stride_ob + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(g < GROUP)[:, None],
        )

    return _split_kernel, _combine_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits_for(batch: int, num_kv_heads: int, num_blocks_per_row: int, blocks_per_tile: int) -> int:
    """Splits of each row's keys: enough programs to fill the GPU, never a split without a tile."""
    tiles = _cdiv(num_blocks_per_row, blocks_per_tile)
    return max(1, min(tiles, _cdiv(TARGET_PROGRAMS, batch * num_kv_heads)))


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
    """q ``[B, Hq, D]``; k/v_cache ``[N, bs, Hkv, D]``; tables ``[B, M]``; first_pos and
    context_lens ``[B]``. Returns ``[B, Hq, D]`` in q's dtype (see the module docstring)."""
    kernel, combine = _kernels()
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if group > G_TILE:
        raise ValueError(f"{group} query heads per KV head: the kernel takes at most {G_TILE}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: the kernel takes a power of two >= 16")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim must be contiguous")
    q = q.contiguous()
    tables = tables.contiguous()
    m = tables.shape[1]
    block_n = max(block_size, 64 if head_dim <= 128 else 32)  # keys per tile: whole cache blocks
    blocks_per_tile = block_n // block_size
    splits = num_splits or num_splits_for(batch, num_kv_heads, m, blocks_per_tile)
    # Whole tiles per split, so that only a row's last tile runs past its table.
    blocks_per_split = _cdiv(_cdiv(m, splits), blocks_per_tile) * blocks_per_tile
    splits = _cdiv(m, blocks_per_split)
    dev = q.device
    out = torch.empty_like(q)
    parts = 1 if splits == 1 else batch * num_kv_heads * splits  # one split: no partial results
    acc = torch.empty(parts * G_TILE * head_dim, dtype=torch.float32, device=dev)
    maxes = torch.empty(parts * G_TILE, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxes)
    kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        first_pos,
        context_lens,
        out,
        acc,
        maxes,
        sums,
        scale,
        m,
        blocks_per_split,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        tables.stride(0),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        G_PAD=G_TILE,
        IEEE=q.dtype == torch.float32,
    )
    if splits > 1:
        combine[(batch, num_kv_heads)](
            out, acc, maxes, sums, splits, out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim, G_PAD=G_TILE
        )
    return out
