// prefill.py: prompt attention, specialised per (group, head dim, vector width)
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"
#include "vector.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(PD_HEAD_DIM) || !defined(PD_GROUP) || !defined(PD_QB)
#error "build.py gives PD_HEAD_DIM, PD_GROUP and PD_QB"
#endif

constexpr int D = PD_HEAD_DIM;
constexpr int G = PD_GROUP;
constexpr int QB = PD_QB;
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
static void kernel(const float* q, const float* k, const float* v, const int64_t* key_rows, float* out,
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

PDSERVE_MODULE(kernel)
