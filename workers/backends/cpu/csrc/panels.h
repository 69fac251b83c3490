// What the panel kernels (panels.cpp: fp32 panels; panels_coded.cpp: coded panels; panels.py)
// share: the panel's tiles of accumulators in vector registers.
#pragma once

#include "vector.h"

#ifndef PD_PANEL
#error "build.py gives PD_PANEL (panels.PANEL)"
#endif

constexpr int P = PD_PANEL;              // panel width (floats)
constexpr int JV = P / VL;               // vectors across a panel
constexpr int JB = JV < 3 ? JV : 3;      // vectors per block
constexpr int MB = VL >= 16 ? 8 : 4;     // input rows per block
static_assert(JV % JB == 0, "a panel is whole blocks");

// a tile's last step: add the bias, write the columns that exist (cols of JB*VL: the last
// panel's padding is not written)
template <int R>
static inline void finish(vf (&acc)[R][JB], float* __restrict__ out, int64_t ldo, int64_t cols,
                          const float* __restrict__ bias) {
  if (bias) {
    alignas(64) float b[JB * VL] = {};
    for (int64_t c = 0; c < cols; ++c) b[c] = bias[c];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) acc[r][j] += load(b + j * VL);
  }
  if (cols == JB * VL) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) store(out + r * ldo + j * VL, acc[r][j]);
  } else {
    alignas(64) float t[JB * VL];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < JB; ++j) store(t + j * VL, acc[r][j]);
      for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = t[c];
    }
  }
}

// f(j0, m0, r, out block, cols, bias block) for each block of panel p: JB vectors of columns at
// a time, and the rows MB at a time (wider batches: the panel stays in L2)
template <class F>
static inline void for_blocks(int64_t p, int64_t M, int64_t N, const float* bias, float* out, F&& f) {
  for (int64_t j0 = 0; j0 < P; j0 += JB * VL) {
    const int64_t col0 = p * P + j0;
    if (col0 >= N) break;
    const int64_t cols = N - col0 < JB * VL ? N - col0 : JB * VL;
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      f(j0, m0, M - m0 < MB ? M - m0 : MB, out + m0 * N + col0, cols, bias ? bias + col0 : nullptr);
  }
}

// one k of a tile, the only arithmetic either kernel does on the inputs: each row's x[r][k]
// (xk: &x[0][k], rows K apart) times the JB weight vectors, added to its accumulators
template <int R>
static inline void step(vf (&acc)[R][JB], const float* __restrict__ xk, int64_t K, const vf (&wv)[JB]) {
  for (int r = 0; r < R; ++r) {
    const vf xb = bcast(xk[r * K]);
    for (int j = 0; j < JB; ++j) acc[r][j] = fmadd(xb, wv[j], acc[r][j]);
  }
}

// out[m][j0 .. j0 + JB*VL) of rows 0..R-1 from one fp32 panel ([K][P])
template <int R>
static inline void tile(const float* __restrict__ x, int64_t K, const float* __restrict__ panel, int64_t j0,
                        float* __restrict__ out, int64_t ldo, int64_t cols, const float* __restrict__ bias) {
  vf acc[R][JB] = {};
  const float* wk = panel + j0;
  for (int64_t k = 0; k < K; ++k, wk += P) {
    vf wv[JB];
    for (int j = 0; j < JB; ++j) wv[j] = load(wk + j * VL);
    step<R>(acc, x + k, K, wv);
  }
  finish<R>(acc, out, ldo, cols, bias);
}
