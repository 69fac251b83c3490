// paged.py: paged decode attention, specialised per cache shape
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(PD_BLOCK_SIZE) || !defined(PD_KV_HEADS) || !defined(PD_GROUP) || !defined(PD_HEAD_DIM)
#error "build.py gives PD_BLOCK_SIZE, PD_KV_HEADS, PD_GROUP and PD_HEAD_DIM (the cache's shape)"
#endif

#ifndef PD_BF16
#define PD_BF16 0  // 1: q, the cache and out are bfloat16 (summed in fp32)
#endif

#define BS PD_BLOCK_SIZE
#define HKV PD_KV_HEADS
#define G PD_GROUP
#define D PD_HEAD_DIM
#define HQ (HKV * G)

using Vec = at::vec::Vectorized<float>;
using T = std::conditional_t<PD_BF16, c10::BFloat16, float>;  // q, cache and output elements
constexpr int64_t VL = Vec::size();
constexpr int64_t DV = D / VL;                   // vectors per head row
constexpr int64_t SV = (BS + VL - 1) / VL;       // vectors per block of scores
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

static inline Vec load(const float* p) { return Vec::loadu(p); }
static inline Vec load(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
}

// One (row, split): blocks [blk0, blk1) of the row's table, every KV head at once (a block is
// read front to back). Writes the split's running max and sum per query head, and its
// unnormalised output (HQ x D).
static inline void task(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const int64_t* __restrict__ table, int64_t first, int64_t query_pos, int64_t window,
    float scale, int64_t blk0, int64_t blk1,
    float* __restrict__ m_out, float* __restrict__ l_out, float* __restrict__ acc_out) {
  Vec qv[HQ][DV];
  Vec acc[HQ][DV];
  float m[HQ], l[HQ];
  for (int64_t i = 0; i < HQ; ++i) {
    for (int64_t j = 0; j < DV; ++j) {
      qv[i][j] = load(q + i * D + j * VL) * Vec(scale);
      acc[i][j] = Vec(0.f);
    }
    m[i] = NEG_INF;
    l[i] = 0.f;
  }
  alignas(64) float s[HQ][SV * VL];  // the block's scores, then their weights
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t pos0 = first + blk * BS;  // this block's first key position
    if (pos0 > query_pos) break;            // this block and the rest lie past the query
    int64_t r0 = 0, r1 = BS;                // the rows the query sees: [r0, r1)
    if (query_pos - pos0 + 1 < r1) r1 = query_pos - pos0 + 1;
    if (window > 0 && query_pos - pos0 >= window) r0 = query_pos - pos0 - window + 1;
    if (r0 >= r1) continue;                 // wholly before the window
    const int64_t phys = table[blk];
    const T* kb = kc + phys * BS * HKV * D;
    const T* vb = vc + phys * BS * HKV * D;
    if (blk + 1 < blk1) {  // the next block lies anywhere in the cache: fetch it while this one runs
      const T* kn = kc + table[blk + 1] * BS * HKV * D;
      const T* vn = vc + table[blk + 1] * BS * HKV * D;
      for (int64_t off = 0; off < BS * HKV * D; off += 64 / sizeof(T)) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    for (int64_t i = 0; i < HQ; ++i)
      for (int64_t r = 0; r < SV * VL; ++r) s[i][r] = NEG_INF;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < HKV; ++h) {
        const T* k = kb + (r * HKV + h) * D;
        Vec kr[DV];
        for (int64_t j = 0; j < DV; ++j) kr[j] = load(k + j * VL);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = h * G + g;
          Vec dot = qv[i][0] * kr[0];
          for (int64_t j = 1; j < DV; ++j) dot = at::vec::fmadd(qv[i][j], kr[j], dot);
          s[i][r] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dot);
        }
      }
    }
    for (int64_t i = 0; i < HQ; ++i) {
      float bm = NEG_INF;
      for (int64_t r = r0; r < r1; ++r) bm = s[i][r] > bm ? s[i][r] : bm;
      if (bm > m[i]) {  // a new maximum: rescale what was summed so far
        const float c = std::exp(m[i] - bm);  // exp(-inf) = 0 on the first block
        l[i] *= c;
        for (int64_t j = 0; j < DV; ++j) acc[i][j] = acc[i][j] * Vec(c);
        m[i] = bm;
      }
      Vec sum(0.f);
      for (int64_t j = 0; j < SV; ++j) {
        Vec e = (Vec::loadu(s[i] + j * VL) - Vec(m[i])).exp();  // masked rows: exp(-inf) = 0
        e.store(s[i] + j * VL);
        sum = sum + e;
      }
      l[i] += at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
    }
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < HKV; ++h) {
        const T* v = vb + (r * HKV + h) * D;
        Vec vr[DV];
        for (int64_t j = 0; j < DV; ++j) vr[j] = load(v + j * VL);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = h * G + g;
          const Vec w(s[i][r]);
          for (int64_t j = 0; j < DV; ++j) acc[i][j] = at::vec::fmadd(w, vr[j], acc[i][j]);
        }
      }
    }
  }
  for (int64_t i = 0; i < HQ; ++i) {
    m_out[i] = m[i];
    l_out[i] = l[i];
    for (int64_t j = 0; j < DV; ++j) acc[i][j].store(acc_out + i * D + j * VL);
  }
}

// q, out: [batch, HQ, D]; kc, vc: [blocks, BS, HKV, D]; tables: [batch, table_stride] (num_blocks
// used a row); first_pos, context_lens: [batch]; window: 0 for none (paged.py's paged_decode).
// fp32: one split's task writes its row's output in place; otherwise (splits, or a bf16 output)
// the tasks write fp32 partial results and the row is combined and rounded at the end.
static void kernel(
    const T* q, const T* kc, const T* vc, const int64_t* tables,
    const int64_t* first_pos, const int64_t* context_lens, T* out,
    int64_t batch, int64_t num_blocks, int64_t table_stride, int64_t window, int64_t splits,
    int64_t threads, float scale) {
  const int64_t per_split = (num_blocks + splits - 1) / splits;
  const int64_t tasks = batch * splits;
  const bool in_place = !PD_BF16 && splits == 1;
  std::vector<float> ms(tasks * HQ), ls(tasks * HQ), accs(in_place ? 0 : tasks * HQ * D);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t b = t / splits, sp = t % splits;
    const int64_t blk0 = sp * per_split;
    const int64_t blk1 = blk0 + per_split < num_blocks ? blk0 + per_split : num_blocks;
    float* acc = in_place ? reinterpret_cast<float*>(out) + b * HQ * D : accs.data() + t * HQ * D;
    task(q + b * HQ * D, kc, vc, tables + b * table_stride, first_pos[b], context_lens[b] - 1,
         window, scale, blk0, blk1, ms.data() + t * HQ, ls.data() + t * HQ, acc);
    if (in_place) {  // normalise in place
      for (int64_t i = 0; i < HQ; ++i) {
        const float inv = ls[t * HQ + i] > 0.f ? 1.f / ls[t * HQ + i] : 0.f;
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= inv;
      }
    }
  }
  if (in_place) return;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {  // combine each row's splits (one for bf16 alone)
    for (int64_t i = 0; i < HQ; ++i) {
      float mx = NEG_INF;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float mi = ms[(b * splits + sp) * HQ + i];
        mx = mi > mx ? mi : mx;
      }
      float o[D];
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      if (mx != NEG_INF) {  // else no key seen: zeros
        float total = 0.f;
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t t = b * splits + sp;
          const float w = std::exp(ms[t * HQ + i] - mx);  // 0 for a split that saw no key
          if (w == 0.f) continue;
          total += w * ls[t * HQ + i];
          const float* a = accs.data() + (t * HQ + i) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
      T* dst = out + (b * HQ + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d]);  // bf16: round to nearest even
    }
  }
}

PDSERVE_MODULE(kernel)
