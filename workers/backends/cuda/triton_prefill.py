"""Prompt attention on CUDA as one hand-written Triton kernel: a prefill chunk's queries against
its keys, read where they lie (the paged cache, through the chunk's block table) or, for a fresh
prompt, from the step's own K/V; causal, with a sliding window, GQA by the kernel (no K/V copied
per query head), fp32/fp16/bf16.

``paged_prefill(q, k, v, table, first_key_pos, context_len, scale, window)`` computes what
``PagedAttention``'s gather + SDPA computes for one chunk, without the gathered copy and without
an ``[n, L]`` score matrix: PyTorch's SDPA with the explicit mask a chunk after cached context
needs (or with fp32, or GQA outside the flash kernel) can land on its math backend, which
expands K/V per query head and holds every score.

Each program takes ``BLOCK_T`` query tokens of one KV head and all ``G`` query heads of that
head, as ``BLOCK_T * G_PAD`` rows of one tile, so K and V are read once per KV head. Keys go by
in tiles of ``BLOCK_N`` (whole cache blocks), only those some query of the tile sees: up to the
tile's last query position (causal) and from its first query's window on. Online softmax in
fp32, ``tl.dot`` on the tensor cores (fp32 in IEEE precision, not TF32). Query ``i`` of the
chunk sits at position ``context_len - n + i``; key ``j`` of the table at ``first_key_pos + j``.

``TRITON_INTERPRET=1`` runs it on CPU tensors (numpy): the tests check it so here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from workers.backends.cuda import triton_available

ROWS = 64  # query rows (tokens x heads of a group) per program


available = triton_available  # asked before the kernels are built


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_tokens", "num_keys", "query_start", "first_key_pos", "window"])
    def prefill_kernel(
        q_ptr,  # [n, Hq, D]
        k_ptr,  # paged: [N, bs, Hkv, D]; dense: [L, Hkv, D]
        v_ptr,
        table_ptr,  # paged: [M] block ids
        out_ptr,  # [n, Hq, D]
        scale,
        num_tokens,  # n
        num_keys,  # L: keys of the table (or dense rows), from first_key_pos on
        query_start,  # position of query 0: context_len - n
        first_key_pos,
        window,  # keys at q - window < k <= q; 0: no window
        stride_qt,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_vn,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block (paged)
        HEAD_DIM: tl.constexpr,
        PAGED: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        r = tl.arange(0, BLOCK_T * G_PAD)
        token = tile * BLOCK_T + r // G_PAD
        g = r % G_PAD
        live = (token < num_tokens) & (g < GROUP)
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        q = tl.load(
            q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=live[:, None],
            other=0.0,
        )
        query_pos = query_start + token

        m_i = tl.full([BLOCK_T * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_T * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_T * G_PAD, HEAD_DIM], tl.float32)

        last_query = tl.minimum(query_start + (tile + 1) * BLOCK_T, query_start + num_tokens) - 1
        hi = tl.minimum(num_keys, last_query - first_key_pos + 1)
        lo = 0
        if window > 0:
            lo = tl.maximum(0, query_start + tile * BLOCK_T - window + 1 - first_key_pos)
            lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            slot = start + n
            in_range = slot < num_keys
            key_pos = first_key_pos + slot
            if PAGED:
                block = tl.load(table_ptr + slot // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
                k_off = block * stride_kn + (slot % BLOCK_SIZE) * stride_kt
                v_off = block * stride_vn + (slot % BLOCK_SIZE) * stride_vt
            else:
                k_off = slot.to(tl.int64) * stride_kt
                v_off = slot.to(tl.int64) * stride_vt
            k = tl.load(k_ptr + k_off[:, None] + kv_head * stride_kh + d[None, :], mask=in_range[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            diff = query_pos[:, None] - key_pos[None, :]
            seen = in_range[None, :] & (diff >= 0)
            if window > 0:
                seen = seen & (diff < window)
            s = tl.where(seen, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            # a slot no query sees may hold anything (NaN in an unwritten one): never read it
            v = tl.load(v_ptr + v_off[:, None] + kv_head * stride_vh + d[None, :], mask=in_range[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=live[:, None],
        )

    return prefill_kernel


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor | None,
    first_key_pos: int,
    context_len: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk's attention. q ``[n, Hq, D]`` (any row and head strides); with ``table`` (the
    chunk's block ids ``[M]``) k/v are a layer's cache ``[N, bs, Hkv, D]`` and the keys are the
    table's first ``context_len - first_key_pos``; without, k/v are the chunk's own ``[n, Hkv, D]``
    (a fresh prompt: ``context_len == n``, ``first_key_pos == 0``). Writes ``out`` (``[n, Hq,
    D]``, default new) and returns it."""
    num_tokens, num_q_heads, head_dim = q.shape
    paged = table is not None
    num_kv_heads = k.shape[2] if paged else k.shape[1]
    block_size = k.shape[1] if paged else 1
    group = num_q_heads // num_kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: the kernel takes a power of two >= 16")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous in q, k and v")
    num_keys = context_len - first_key_pos
    if not paged and (k.shape[0] < num_keys or first_key_pos != 0 or context_len != num_tokens):
        raise ValueError("a fresh prompt's keys are its own: context_len == n, first_key_pos 0")
    if out is None:
        out = torch.empty_like(q)
    g_pad = _next_pow2(group)
    block_t = max(1, ROWS // g_pad)
    block_n = max(block_size, 64 if head_dim <= 128 else 32)
    if paged:
        assert table is not None
        table = table.contiguous()
        kn, kt, kh = k.stride(0), k.stride(1), k.stride(2)
        vn, vt, vh = v.stride(0), v.stride(1), v.stride(2)
    else:
        table = q  # unused
        kn, kt, kh = 0, k.stride(0), k.stride(1)
        vn, vt, vh = 0, v.stride(0), v.stride(1)
    grid = (-(-num_tokens // block_t), num_kv_heads)
    _kernel()[grid](
        q,
        k,
        v,
        table,
        out,
        scale,
        num_tokens,
        num_keys,
        context_len - num_tokens,
        first_key_pos,
        window or 0,
        q.stride(0),
        q.stride(1),
        kn,
        kt,
        kh,
        vn,
        vt,
        vh,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        PAGED=paged,
        IEEE=q.dtype == torch.float32,
    )
    return out
