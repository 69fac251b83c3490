"""Prompt attention on CPU (fp32) as one hand-written C++ kernel: causal, GQA, sliding window,
over the step's own K/V (a fresh prompt) or the paged cache (a chunk after cached context),
without a gathered copy.

A prompt's attention went to ``F.scaled_dot_product_attention``: aten's flash kernel for CPU
(``cpu_flash_attention``) for a fresh prompt, and for a chunk after cached tokens the same kernel
with an additive mask over a gathered copy of the sequence's blocks. On 2 cores (Zen 4, SmolLM2's
shapes: 9 query heads over 3 KV heads of 64) it ran a 256-token prompt's 30 layers in 41 ms, 55
GFLOPS of the causal half's arithmetic, an eighth of a 256-token prefill; at 1024 tokens 400
ms. It cuts a 256-token prompt's queries into blocks of 64 and its keys into blocks of 512
(``cpu_flash_attention<float, float, 64, 512>`` in ``perf``), so every query block multiplies
every key of the prompt and masks the causal half away; each query head of a GQA group reads its
K/V apart, and each block product goes through MKL's sgemm.

Here one task takes one KV head and ``QB`` consecutive queries: the ``QB x G`` query rows of
that head's group, stacked (position-major), share every K/V row they read. The task walks the
keys the block can see (from the window's start, or the first key, to its last query's
position) ``KC`` at a time. For each chunk it copies the chunk's K rows transposed into a
``[D][KC]`` buffer (so a score row is ``D`` broadcast-and-FMA steps over ``KC / VL`` vectors,
with ``MS`` rows' scores in registers: the panel kernel's tile, ``cpu_linear``), masks what a
row may not see (only in the chunks that cross a row's causal edge or window start), updates
each row's running maximum and sum (online softmax, exponentials through ``at::vec``'s Sleef
``exp``) and adds the chunk's V rows weighted by the row's probabilities into the row's output,
``MO`` rows of ``D`` in registers at a time. Tasks run in order of decreasing work (the last
query blocks see the most keys) under OpenMP's dynamic schedule. Keys are addressed through a
row index per key (``key_rows``): a fresh prompt's are its own rows of the step's K/V, a
chunk's are its cache slots (``table[j // bs] * bs + j % bs``), so one kernel reads either and
the cache is read in place.

Not bit for bit SDPA: the sums run in another order (each score is ``D`` FMAs from ``k = 0``
up, each output a sum over keys in position order). The engine's greedy parity with
transformers is held by its tests with this kernel on (``test_engine_parity.py``,
``test_real_model.py``, ``test_cpu_prefill.py``), as for the panel kernel. The paged backend
(CPU's default) runs it (``PagedAttention._prefill_kernel``); ``cpu_prefill.enabled = False``
turns it off, and the SDPA backend (``attention_backend="sdpa"``) stays the reference. Built
once per (group, head dim) through inductor's C++ toolchain, as ``cpu_paged`` is; where it cannot
be built prompts keep SDPA.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from workers.backends.cpu.panels import VECTOR_PRELUDE

logger = logging.getLogger(__name__)

enabled = True  # the engine's switch (tests and benchmarks flip it: the SDPA path runs instead)
QB = 64  # query positions per task (x the group's heads: the rows that share a K/V chunk)

_SOURCE = (
    VECTOR_PRELUDE
    + r"""
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

constexpr int D = {head_dim};
constexpr int G = {group};
constexpr int QB = {qb};
constexpr int R_MAX = QB * G;               // stacked query rows of a task
constexpr int DV = D / VL;                   // vectors per head row
constexpr int NV = 4;                        // vectors of keys per chunk
constexpr int KC = NV * VL;                  // keys per chunk
constexpr int MS = VL >= 16 ? 6 : 3;         // score rows in registers (MS x NV accumulators)
constexpr int MO_ = (VL >= 16 ? 24 : 12) / DV;
constexpr int MO = MO_ < 1 ? 1 : (MO_ > MS ? MS : MO_);  // output rows in registers (MO x DV)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
static_assert(D % VL == 0, "a head row is whole vectors");

using AVec = at::vec::Vectorized<float>;
static_assert(KC % AVec::size() == 0, "a chunk of scores is whole at::vec vectors");

// s[r][0..U*VL) = q[r] . kt[.][j] for R stacked rows (q rows D apart, kt [D][KC]): the first U
// vectors of the chunk's keys (the ones some row of the block sees)
template <int R, int U>
static inline void scores(const float* __restrict__ q, const float* __restrict__ kt, float* __restrict__ s) {
  vf acc[R][U] = {};
  for (int d = 0; d < D; ++d) {
    vf kv[U];
    for (int v = 0; v < U; ++v) kv[v] = load(kt + d * KC + v * VL);
    for (int r = 0; r < R; ++r) {
      const vf qb = bcast(q[r * D + d]);
      for (int v = 0; v < U; ++v) acc[r][v] = fmadd(qb, kv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < U; ++v) store(s + r * KC + v * VL, acc[r][v]);
}

// o[r] += sum_j p[r][j] * vrows[j] for R rows (o rows D apart, p rows KC apart), keys [0, nk)
template <int R>
static inline void weighted_values(float* __restrict__ o, const float* __restrict__ p,
                                   const float* const* __restrict__ vrows, int64_t nk) {
  vf acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) acc[r][v] = load(o + r * D + v * VL);
  for (int64_t j = 0; j < nk; ++j) {
    vf vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = load(vrows[j] + v * VL);
    for (int r = 0; r < R; ++r) {
      const vf w = bcast(p[r * KC + j]);
      for (int v = 0; v < DV; ++v) acc[r][v] = fmadd(w, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) store(o + r * D + v * VL, acc[r][v]);
}

// q: query i's head h row at q + i * q_stride + h * D; k: key j's KV head row at
// k + key_rows[j] * k_stride + h * D, v likewise (v_stride); out as q (out_stride). Query i sits at position
// q_pos0 + i, key j at k_pos0 + j; a key counts when its position is at most the query's and,
// with a window, less than window before it.
extern "C" void kernel(const float* q, const float* k, const float* v, const int64_t* key_rows, float* out,
                       int64_t n, int64_t num_keys, int64_t num_kv_heads, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, int64_t out_stride, int64_t q_pos0, int64_t k_pos0, int64_t window,
                       int64_t threads, float scale) {
  const int64_t blocks = (n + QB - 1) / QB;
  const int64_t tasks = blocks * num_kv_heads;
  #pragma omp parallel num_threads(threads)
  {
  // a thread's buffers (heap: a group of 8 heads of 128 would be half a MB): the block's scaled
  // queries and outputs, the chunk's transposed keys, a block of scores
  std::vector<float> buffers(2 * R_MAX * D + D * KC + MS * KC + 2 * R_MAX + 16);
  float* base = buffers.data();
  while (reinterpret_cast<uintptr_t>(base) % 64) ++base;
  float* __restrict__ qs = base;
  float* __restrict__ o = qs + R_MAX * D;
  float* __restrict__ kt = o + R_MAX * D;
  float* __restrict__ s = kt + D * KC;
  float* __restrict__ m = s + MS * KC;
  float* __restrict__ l = m + R_MAX;
  const float* vrows[KC];
  #pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = blocks - 1 - t / num_kv_heads;  // the last blocks (the most keys) first
    const int64_t h = t % num_kv_heads;
    const int64_t i0 = qb * QB, i1 = i0 + QB < n ? i0 + QB : n;
    const int64_t rows = (i1 - i0) * G;
    for (int64_t i = i0; i < i1; ++i)
      for (int g = 0; g < G; ++g) {
        const float* src = q + i * q_stride + (h * G + g) * D;
        float* dst = qs + ((i - i0) * G + g) * D;
        for (int v = 0; v < DV; ++v) store(dst + v * VL, load(src + v * VL) * bcast(scale));
      }
    for (int64_t r = 0; r < rows * D; ++r) o[r] = 0.f;
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = NEG_INF;
      l[r] = 0.f;
    }
    // the keys this block sees: [jlo, jhi)
    const int64_t last = q_pos0 + i1 - 1 - k_pos0;  // the last query's position, as a key index
    const int64_t jhi = last + 1 < num_keys ? last + 1 : num_keys;
    int64_t jlo = 0;
    if (window > 0 && q_pos0 + i0 - window + 1 - k_pos0 > 0) jlo = q_pos0 + i0 - window + 1 - k_pos0;
    for (int64_t c0 = jlo; c0 < jhi; c0 += KC) {
      const int64_t nk = jhi - c0 < KC ? jhi - c0 : KC;
      for (int64_t j = 0; j < nk; ++j) {
        const float* kr = k + key_rows[c0 + j] * k_stride + h * D;
        for (int d = 0; d < D; ++d) kt[d * KC + j] = kr[d];
        vrows[j] = v + key_rows[c0 + j] * v_stride + h * D;
      }
      for (int64_t j = nk; j < KC; ++j)
        for (int d = 0; d < D; ++d) kt[d * KC + j] = 0.f;
      for (int64_t r0 = 0; r0 < rows; r0 += MS) {
        const int64_t mr = rows - r0 < MS ? rows - r0 : MS;
        // keys [0, used) of the chunk: the most any row of the block sees (its last row's), and
        // the scores made: [0, ext), whole at::vec vectors and whole vf vectors
        const int64_t last_row = q_pos0 + i0 + (r0 + mr - 1) / G - k_pos0 - c0 + 1;
        const int64_t used = last_row < nk ? last_row : nk;
        if (used <= 0) continue;  // every row of the block lies before this chunk
        int64_t ext = (used + AVec::size() - 1) / AVec::size() * AVec::size();
        if (ext > KC) ext = KC;
        with_count<MS>(mr, [&](auto R) {
          with_count<NV>((ext + VL - 1) / VL, [&](auto U) { scores<R(), U()>(qs + r0 * D, kt, s); });
        });
        for (int64_t r = 0; r < mr; ++r) {
          float* sr = s + r * KC;
          const int64_t qpos = q_pos0 + i0 + (r0 + r) / G - k_pos0;  // as a key index
          int64_t a = 0, b = qpos - c0 + 1 < nk ? qpos - c0 + 1 : nk;  // keys [a, b) of the chunk
          if (window > 0 && qpos - window + 1 - c0 > 0) a = qpos - window + 1 - c0;
          if (a >= b) {  // nothing of this chunk: no weight
            for (int64_t j = 0; j < ext; ++j) sr[j] = 0.f;
            continue;
          }
          for (int64_t j = 0; j < a; ++j) sr[j] = NEG_INF;
          for (int64_t j = b; j < ext; ++j) sr[j] = NEG_INF;
          AVec mx(NEG_INF);
          for (int64_t j = 0; j < ext; j += AVec::size()) mx = at::vec::maximum(mx, AVec::loadu(sr + j));
          const float bm = at::vec::vec_reduce_all<float>([](AVec& x, AVec& y) { return at::vec::maximum(x, y); }, mx);
          float* orow = o + (r0 + r) * D;
          if (bm > m[r0 + r]) {  // a new maximum: rescale what was summed so far
            const float c = std::exp(m[r0 + r] - bm);  // exp(-inf) = 0 on the row's first chunk
            l[r0 + r] *= c;
            for (int v = 0; v < DV; ++v) store(orow + v * VL, load(orow + v * VL) * bcast(c));
            m[r0 + r] = bm;
          }
          const AVec mv(m[r0 + r]);
          AVec sum(0.f);
          for (int64_t j = 0; j < ext; j += AVec::size()) {
            const AVec e = (AVec::loadu(sr + j) - mv).exp();  // masked keys: exp(-inf) = 0
            e.store(sr + j);
            sum = sum + e;
          }
          l[r0 + r] += at::vec::vec_reduce_all<float>([](AVec& x, AVec& y) { return x + y; }, sum);
        }
        for (int64_t p0 = 0; p0 < mr; p0 += MO) {
          const int64_t pr = mr - p0 < MO ? mr - p0 : MO;
          with_count<MO>(pr, [&](auto R) { weighted_values<R()>(o + (r0 + p0) * D, s + p0 * KC, vrows, used); });
        }
      }
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int g = 0; g < G; ++g) {
        const int64_t r = (i - i0) * G + g;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        float* dst = out + i * out_stride + (h * G + g) * D;
        for (int v = 0; v < DV; ++v) store(dst + v * VL, load(o + r * D + v * VL) * bcast(inv));
      }
  }
  }
}
"""
)

ARGTYPES = [
    "const float*",  # q
    "const float*",  # k
    "const float*",  # v
    "const int64_t*",  # key_rows
    "float*",  # out
    "int64_t",  # n (queries)
    "int64_t",  # num_keys
    "int64_t",  # num_kv_heads
    "int64_t",  # q row stride
    "int64_t",  # k row stride
    "int64_t",  # v row stride
    "int64_t",  # out row stride
    "int64_t",  # q_pos0
    "int64_t",  # k_pos0
    "int64_t",  # window (0: none)
    "int64_t",  # threads
    "float",  # scale
]


def _source(group: int, head_dim: int, max_vector_floats: int) -> str:
    return (
        _SOURCE.replace("{head_dim}", str(head_dim))
        .replace("{group}", str(group))
        .replace("{qb}", str(QB))
        .replace("{max_vl}", str(max_vector_floats))
    )


@functools.cache
def build(group: int, head_dim: int, max_vector_floats: int) -> Any:
    """The kernel for one (group, head dim), with vectors of at most ``max_vector_floats`` floats
    (16: AVX-512 where the CPU has it; below that only for the tests). Every caller passes all
    three (one cache key per kernel)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, _source(group, head_dim, max_vector_floats))


@functools.cache
def available(group: int, head_dim: int) -> bool:
    """Whether the kernel builds here for this shape (asked once per shape; a failure is logged
    and prompts keep SDPA)."""
    try:
        build(group, head_dim, 16)
    except Exception as exc:  # noqa: BLE001 - no compiler, an inductor without this API ...
        logger.warning(
            "the CPU prompt-attention kernel did not build (%s: %s); prompts keep SDPA", type(exc).__name__, exc
        )
        return False
    return True


def _rows_of_heads(x: torch.Tensor) -> bool:
    """``[rows, heads, dim]`` fp32 on CPU whose heads lie one after another in each row."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs this attention: CPU fp32, a head dim of whole 16-float vectors,
    rows whose heads are contiguous, and the kernel built for the shape."""
    return (
        enabled
        and _rows_of_heads(q)
        and _rows_of_heads(k)
        and _rows_of_heads(v)
        and q.shape[-1] % 16 == 0
        and q.shape[-2] % k.shape[-2] == 0
        and available(q.shape[-2] // k.shape[-2], q.shape[-1])
    )


def check_key_rows(key_rows: torch.Tensor, num_rows: int) -> None:
    """Raise ``IndexError`` for a key row outside ``[0, num_rows)`` (the kernel reads it unchecked)."""
    if key_rows.numel() and (int(key_rows.min()) < 0 or int(key_rows.max()) >= num_rows):
        raise IndexError(f"a key row is outside the {num_rows} rows of k and v")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_rows: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    max_vector_floats: int = 16,
    check: bool = True,
) -> torch.Tensor:
    """Attention of ``n`` queries over ``len(key_rows)`` keys (see the module docstring).

    q ``[n, Hq, D]`` and out (made if None) ``[n, Hq, D]``, any row stride; k and v
    ``[rows, Hkv, D]``, any row strides (the step's K/V, or a cache layer's flat view);
    key_rows ``[L]`` int64, key ``j``'s row of k/v. Query ``i`` is at position ``q_pos0 + i``,
    key ``j`` at ``k_pos0 + j``; every query must see at least its own position's key. ``check=False``
    skips ``check_key_rows`` (a caller that checked the step's rows once for every layer)."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if v.shape[1:] != k.shape[1:] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if out is None:
        out = torch.empty(n, num_q_heads, head_dim, dtype=q.dtype)
    elif out.shape != q.shape or not _rows_of_heads(out):
        raise ValueError(f"out {tuple(out.shape)} must be q's shape {tuple(q.shape)} with each row's heads contiguous")
    if n == 0:
        return out
    key_rows = key_rows.contiguous()
    if check:
        check_key_rows(key_rows, k.shape[0])
    kernel = build(num_q_heads // num_kv_heads, head_dim, max_vector_floats)
    kernel(
        q,
        k,
        v,
        key_rows,
        out,
        n,
        key_rows.numel(),
        num_kv_heads,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        q_pos0,
        k_pos0,
        window or 0,
        torch.get_num_threads(),
        float(scale),
    )
    return out
