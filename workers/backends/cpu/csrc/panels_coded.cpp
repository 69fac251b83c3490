// panels.py: the kernel on coded panels (CodedPanels, build_coded)
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"
#include "panels.h"

#include <vector>

#ifndef PD_GROUP
#error "build.py gives PD_GROUP (panels.GROUP)"
#endif
constexpr int G = PD_GROUP;  // k's per (step, offset) pair

// VL codes (bytes) as floats
static inline vf codes(const uint8_t* q) {
#if defined(VEC_AVX512)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q)));
#elif defined(VEC_AVX2)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q)));
#else
  vf v;
  for (int i = 0; i < VL; ++i) v[i] = (float)q[i];
  return v;
#endif
}

// Coded panels (CodedPanels): codes [num_panels][K][P] (bytes), scales [num_panels][K / G][2][P]
// (fp32: each group's step d, then its offset m). A weight is fma(d, code, m), which (d * code
// exact) is the fp32 weight itself, so the sums are the fp32 panel's, bit for bit.

// one row block of a panel straight from its codes: the weights are made in registers
template <int R>
static inline void coded_tile(const float* __restrict__ x, int64_t K, const uint8_t* __restrict__ q,
                              const float* __restrict__ s, int64_t j0, float* __restrict__ out, int64_t ldo,
                              int64_t cols, const float* __restrict__ bias) {
  vf acc[R][JB] = {};
  const uint8_t* qk = q + j0;
  const float* sg = s + j0;
  for (int64_t k0 = 0; k0 < K; k0 += G, sg += 2 * P) {
    vf d[JB], m[JB];
    for (int j = 0; j < JB; ++j) d[j] = load(sg + j * VL), m[j] = load(sg + P + j * VL);
    for (int64_t k = k0; k < k0 + G; ++k, qk += P) {
      vf wv[JB];
      for (int j = 0; j < JB; ++j) wv[j] = fmadd(d[j], codes(qk + j * VL), m[j]);
      step<R>(acc, x + k, K, wv);
    }
  }
  finish<R>(acc, out, ldo, cols, bias);
}

// a whole panel's fp32 weights ([K][P]), for batches of several row blocks: made once, then
// read from L2 by each block, as the fp32 panel would be
static void decode_panel(const uint8_t* __restrict__ q, const float* __restrict__ s, int64_t K,
                         float* __restrict__ panel) {
  for (int64_t k0 = 0; k0 < K; k0 += G, s += 2 * P)
    for (int64_t k = k0; k < k0 + G; ++k)
      for (int j = 0; j < JV; ++j)
        store(panel + k * P + j * VL, fmadd(load(s + j * VL), codes(q + k * P + j * VL), load(s + P + j * VL)));
}

// x: [M, K]; codes_, scales: CodedPanels'; bias: [N] (read only with has_bias); out: [M, N]
static void kernel(const float* x, const uint8_t* codes_, const float* scales, const float* bias, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias, int64_t threads) {
  if (!has_bias) bias = nullptr;
  const int64_t num_panels = (N + P - 1) / P;
  const bool wide = M > MB;  // several row blocks: each panel's weights made once (decode_panel)
  #pragma omp parallel num_threads(threads)
  {
    std::vector<float> decoded(wide ? K * P : 0);  // this thread's panel
    #pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < num_panels; ++p) {
      const uint8_t* q = codes_ + p * K * P;
      const float* s = scales + p * (K / G) * 2 * P;
      if (wide) decode_panel(q, s, K, decoded.data());
      for_blocks(p, M, N, bias, out, [&](int64_t j0, int64_t m0, int64_t r, float* o, int64_t cols, const float* b) {
        with_count<MB>(r, [&](auto R) {
          if (wide)
            tile<R()>(x + m0 * K, K, decoded.data(), j0, o, N, cols, b);
          else
            coded_tile<R()>(x + m0 * K, K, q, s, j0, o, N, cols, b);
        });
      });
    }
  }
}

PDSERVE_MODULE(kernel)
