// fused.py: norm
#include "binding.h"
#include "fused.h"

#ifndef PD_PARALLEL_ROWS
#error "build.py gives PD_PARALLEL_ROWS (fused.PARALLEL_ROWS)"
#endif
// batches of at least this many rows split their rows over the threads
#define PARALLEL_ROWS PD_PARALLEL_ROWS

static inline int64_t ceil_log2(int64_t x) {  // aten's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll((uint64_t)(x - 1));
}

// aten's sum of a contiguous row of V-float vectors (vectorized_inner_sum -> row_sum ->
// multi_row_sum with 4 interleaved rows and 4 levels), over the squares of h; each lane is its
// own chain of additions, so GCC's vector types (held in registers) keep aten's order
template <typename vec, int V>
static float sum_squares(const float* __restrict__ h, int64_t n) {
  auto sq = [&](int64_t v) { const vec a = load<vec>(h + v * V); return a * a; };
  const int64_t vec_size = n / V;
  const int64_t size_ilp = vec_size / 4;
  vec acc[4][4] = {};
  const int64_t level_power = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
  const int64_t level_step = (int64_t)1 << level_power;
  const int64_t level_mask = level_step - 1;
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += sq(i * 4 + k);
    for (int64_t j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = vec{};
      }
      const int64_t mask = level_mask << (j * level_power);
      if ((i & mask) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += sq(i * 4 + k);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  // row_sum: the vectors past the last group of four go into the first row, then the rows add up
  for (int64_t v = size_ilp * 4; v < vec_size; ++v) acc[0][0] += sq(v);
  for (int k = 1; k < 4; ++k) acc[0][0] += acc[0][k];
  // vectorized_inner_sum: the scalar tail first, then the lanes in order
  float total = 0.0f;
  for (int64_t e = vec_size * V; e < n; ++e) total += h[e] * h[e];
  for (int l = 0; l < V; ++l) total += acc[0][0][l];
  return total;
}

// elementwise work in 16-float vectors (each lane one rounding, as aten's), then a scalar tail
template <typename vec, int V>
static void norm_row(const float* __restrict__ x, const float* __restrict__ res, float* __restrict__ hout,
                     const float* __restrict__ w, float* __restrict__ out, int64_t n, float eps) {
  const int64_t whole = n / 16 * 16;
  const float* h = x;
  if (res != nullptr) {
    for (int64_t e = 0; e < whole; e += 16) store<vf16>(hout + e, load<vf16>(x + e) + load<vf16>(res + e));
    for (int64_t e = whole; e < n; ++e) hout[e] = x[e] + res[e];
    h = hout;
  }
  float var = sum_squares<vec, V>(h, n) / (float)n;
  var = var + eps;
  const float r = 1.0f / sqrtf(var);
  for (int64_t e = 0; e < whole; e += 16) store<vf16>(out + e, load<vf16>(w + e) * (load<vf16>(h + e) * r));
  for (int64_t e = whole; e < n; ++e) out[e] = w[e] * (h[e] * r);
}

// x, residual, h: [rows, n] contiguous (residual and h unused without has_residual); weight [n];
// out [rows, n]. eps: added to the fp32 mean as an fp32 number (as aten adds it); width: the vector
// width (floats) of aten's sums (fused.norm_width); threads: for batches of PARALLEL_ROWS rows or more
static void kernel(const float* x, const float* residual, float* h, const float* weight, float* out,
                       int64_t rows, int64_t n, int64_t has_residual, float eps, int64_t width,
                       int64_t threads) {
  const int64_t nt = rows >= PARALLEL_ROWS ? threads : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t m = 0; m < rows; ++m) {
    const float* res = has_residual ? residual + m * n : nullptr;
    float* hm = has_residual ? h + m * n : nullptr;
    if (width == 16) norm_row<vf16, 16>(x + m * n, res, hm, weight, out + m * n, n, eps);
    else norm_row<vf8, 8>(x + m * n, res, hm, weight, out + m * n, n, eps);
  }
}

PDSERVE_MODULE(kernel)
