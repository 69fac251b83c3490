"""Paged decode attention on CPU as one hand-written C++ kernel (split-K, online softmax).

``paged_decode(q, k_cache, v_cache, tables, first_pos, context_lens, scale, window)`` computes
what ``paged_attention._paged_decode`` does (one query per row over the blocks of its table,
causal and within the sliding window, GQA) for an fp32 cache, without a gathered copy. The
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

The source is compiled once per (block size, KV heads, group, head dim) through inductor's own
C++ toolchain (``CppPythonBindingsCodeCache``: the compiler, flags, OpenMP and vector ISA that
inductor uses for the CPU kernels it generates, and its on-disk cache), so it needs what the
``paged`` backend needed already: a C++ compiler. When it cannot be built the backend keeps the
inductor kernel (``available`` says which).

A key counts when its position is at most the query's (the row's context length - 1) and, with a
window, less than ``window`` before it. Positions grow along a table, so the walk stops at the
first block that starts past the query; whatever an unread or masked slot holds cannot reach the
output (its weight is exactly 0 and its V row is never loaded).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

TASKS_PER_THREAD = 4  # split a row's blocks until there are this many tasks per thread

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <omp.h>
#include <cmath>
#include <limits>
#include <vector>

#define BS {block_size}
#define HKV {num_kv_heads}
#define G {group}
#define D {head_dim}
#define HQ (HKV * G)

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
constexpr int64_t DV = D / VL;                   // vectors per head row
constexpr int64_t SV = (BS + VL - 1) / VL;       // vectors per block of scores
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// One (row, split): blocks [blk0, blk1) of the row's table, every KV head at once (a block is
// read front to back). Writes the split's running max and sum per query head, and its
// unnormalised output (HQ x D).
static inline void task(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
    const int64_t* __restrict__ table, int64_t first, int64_t query_pos, int64_t window,
    float scale, int64_t blk0, int64_t blk1,
    float* __restrict__ m_out, float* __restrict__ l_out, float* __restrict__ acc_out) {{
  Vec qv[HQ][DV];
  Vec acc[HQ][DV];
  float m[HQ], l[HQ];
  for (int64_t i = 0; i < HQ; ++i) {{
    for (int64_t j = 0; j < DV; ++j) {{
      qv[i][j] = Vec::loadu(q + i * D + j * VL) * Vec(scale);
      acc[i][j] = Vec(0.f);
    }}
    m[i] = NEG_INF;
    l[i] = 0.f;
  }}
  alignas(64) float s[HQ][SV * VL];  // the block's scores, then their weights
  for (int64_t blk = blk0; blk < blk1; ++blk) {{
    const int64_t pos0 = first + blk * BS;  // this block's first key position
    if (pos0 > query_pos) break;            // this block and the rest lie past the query
    int64_t r0 = 0, r1 = BS;                // the rows the query sees: [r0, r1)
    if (query_pos - pos0 + 1 < r1) r1 = query_pos - pos0 + 1;
    if (window > 0 && query_pos - pos0 >= window) r0 = query_pos - pos0 - window + 1;
    if (r0 >= r1) continue;                 // wholly before the window
    const int64_t phys = table[blk];
    const float* kb = kc + phys * BS * HKV * D;
    const float* vb = vc + phys * BS * HKV * D;
    if (blk + 1 < blk1) {{  // the next block lies anywhere in the cache: fetch it while this one runs
      const float* kn = kc + table[blk + 1] * BS * HKV * D;
      const float* vn = vc + table[blk + 1] * BS * HKV * D;
      for (int64_t off = 0; off < BS * HKV * D; off += 16) {{
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }}
    }}
    for (int64_t i = 0; i < HQ; ++i)
      for (int64_t r = 0; r < SV * VL; ++r) s[i][r] = NEG_INF;
    for (int64_t r = r0; r < r1; ++r) {{
      for (int64_t h = 0; h < HKV; ++h) {{
        const float* k = kb + (r * HKV + h) * D;
        Vec kr[DV];
        for (int64_t j = 0; j < DV; ++j) kr[j] = Vec::loadu(k + j * VL);
        for (int64_t g = 0; g < G; ++g) {{
          const int64_t i = h * G + g;
          Vec dot = qv[i][0] * kr[0];
          for (int64_t j = 1; j < DV; ++j) dot = at::vec::fmadd(qv[i][j], kr[j], dot);
          s[i][r] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) {{ return x + y; }}, dot);
        }}
      }}
    }}
    for (int64_t i = 0; i < HQ; ++i) {{
      float bm = NEG_INF;
      for (int64_t r = r0; r < r1; ++r) bm = s[i][r] > bm ? s[i][r] : bm;
      if (bm > m[i]) {{  // a new maximum: rescale what was summed so far
        const float c = std::exp(m[i] - bm);  // exp(-inf) = 0 on the first block
        l[i] *= c;
        for (int64_t j = 0; j < DV; ++j) acc[i][j] = acc[i][j] * Vec(c);
        m[i] = bm;
      }}
      Vec sum(0.f);
      for (int64_t j = 0; j < SV; ++j) {{
        Vec e = (Vec::loadu(s[i] + j * VL) - Vec(m[i])).exp();  // masked rows: exp(-inf) = 0
        e.store(s[i] + j * VL);
        sum = sum + e;
      }}
      l[i] += at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) {{ return x + y; }}, sum);
    }}
    for (int64_t r = r0; r < r1; ++r) {{
      for (int64_t h = 0; h < HKV; ++h) {{
        const float* v = vb + (r * HKV + h) * D;
        Vec vr[DV];
        for (int64_t j = 0; j < DV; ++j) vr[j] = Vec::loadu(v + j * VL);
        for (int64_t g = 0; g < G; ++g) {{
          const int64_t i = h * G + g;
          const Vec w(s[i][r]);
          for (int64_t j = 0; j < DV; ++j) acc[i][j] = at::vec::fmadd(w, vr[j], acc[i][j]);
        }}
      }}
    }}
  }}
  for (int64_t i = 0; i < HQ; ++i) {{
    m_out[i] = m[i];
    l_out[i] = l[i];
    for (int64_t j = 0; j < DV; ++j) acc[i][j].store(acc_out + i * D + j * VL);
  }}
}}

extern "C" void kernel(
    const float* q, const float* kc, const float* vc, const int64_t* tables,
    const int64_t* first_pos, const int64_t* context_lens, float* out,
    int64_t batch, int64_t num_blocks, int64_t table_stride, int64_t window, int64_t splits,
    int64_t threads, float scale) {{
  const int64_t per_split = (num_blocks + splits - 1) / splits;
  const int64_t tasks = batch * splits;
  std::vector<float> ms(tasks * HQ), ls(tasks * HQ), accs(splits > 1 ? tasks * HQ * D : 0);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {{
    const int64_t b = t / splits, sp = t % splits;
    const int64_t blk0 = sp * per_split;
    const int64_t blk1 = blk0 + per_split < num_blocks ? blk0 + per_split : num_blocks;
    float* acc = splits > 1 ? accs.data() + t * HQ * D : out + b * HQ * D;
    task(q + b * HQ * D, kc, vc, tables + b * table_stride, first_pos[b], context_lens[b] - 1,
         window, scale, blk0, blk1, ms.data() + t * HQ, ls.data() + t * HQ, acc);
    if (splits == 1) {{  // normalise in place
      for (int64_t i = 0; i < HQ; ++i) {{
        const float inv = ls[t * HQ + i] > 0.f ? 1.f / ls[t * HQ + i] : 0.f;
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= inv;
      }}
    }}
  }}
  if (splits == 1) return;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {{  // combine each row's splits
    for (int64_t i = 0; i < HQ; ++i) {{
      float mx = NEG_INF;
      for (int64_t sp = 0; sp < splits; ++sp) {{
        const float mi = ms[(b * splits + sp) * HQ + i];
        mx = mi > mx ? mi : mx;
      }}
      float* o = out + (b * HQ + i) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      if (mx == NEG_INF) continue;  // no key seen: zeros
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) {{
        const int64_t t = b * splits + sp;
        const float w = std::exp(ms[t * HQ + i] - mx);  // 0 for a split that saw no key
        if (w == 0.f) continue;
        total += w * ls[t * HQ + i];
        const float* a = accs.data() + (t * HQ + i) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }}
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }}
  }}
}}
"""

ARGTYPES = [
    "const float*",  # q
    "const float*",  # k_cache
    "const float*",  # v_cache
    "const int64_t*",  # tables
    "const int64_t*",  # first_pos
    "const int64_t*",  # context_lens
    "float*",  # out
    "int64_t",  # batch
    "int64_t",  # blocks per row
    "int64_t",  # table stride
    "int64_t",  # window (0: none)
    "int64_t",  # splits
    "int64_t",  # threads
    "float",  # scale
]


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: fp32 on CPU, a head dim of whole vectors (16 floats
    covers AVX2's 8 and AVX-512's 16), contiguous cache rows."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and q.shape[-1] % 16 == 0
        and k_cache.is_contiguous()
    )


@functools.cache
def _kernel(block_size: int, num_kv_heads: int, group: int, head_dim: int) -> Any:
    """The compiled kernel for one cache shape (inductor's compile cache keeps it on disk)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = _SOURCE.format(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, source)


@functools.cache
def available(block_size: int, num_kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether the kernel builds for this shape here (asked once per shape; a failure is logged
    and the caller keeps the inductor kernel)."""
    try:
        _kernel(block_size, num_kv_heads, group, head_dim)
    except Exception as exc:  # noqa: BLE001 - no compiler, an inductor without this API ...
        logger.warning(
            "the CPU paged-attention kernel did not build (%s: %s); using inductor's", type(exc).__name__, exc
        )
        return False
    return True


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
    context_lens ``[B]`` int64. Returns ``[B, Hq, D]`` fp32 (see the module docstring)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    kernel = _kernel(block_size, num_kv_heads, group, head_dim)
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
