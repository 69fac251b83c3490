// fused.py: swiglu
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"

#include <cmath>
#include <cstdint>

// gu: [rows, 2 * inner], rows ld floats apart: the gate's columns, then the up projection's;
// out: [rows, inner] contiguous. out = silu(gate) * up, silu as aten's silu_kernel computes it
// on a contiguous inner loop: at::vec's x / (1 + exp(-x)) (Sleef's vector exp) for two vectors at
// a time, then x / (1 + std::exp(-x)) for the tail past the last pair (Loops.h's
// vectorized_loop, then basic_loop); the product rounded once, as aten's mul
static void kernel(const float* gu, float* out, int64_t rows, int64_t inner, int64_t ld) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec one(1.0f);
  for (int64_t m = 0; m < rows; ++m) {
    const float* g = gu + m * ld;
    const float* u = g + inner;
    float* o = out + m * inner;
    int64_t e = 0;
    for (; e + 2 * W <= inner; e += 2 * W) {
      for (int64_t j = e; j < e + 2 * W; j += W) {
        const Vec x = Vec::loadu(g + j);
        const Vec s = x / (one + x.neg().exp());
        (s * Vec::loadu(u + j)).store(o + j);
      }
    }
    for (; e < inner; ++e) {
      const float x = g[e];
      const float s = x / (1.0f + std::exp(-x));
      o[e] = s * u[e];
    }
  }
}

PDSERVE_MODULE(kernel)
