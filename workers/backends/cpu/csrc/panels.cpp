// panels.py: the kernel on fp32 panels (build)
#include <pdserve_prelude.h>  // first: its precompiled copy (build.py)

#include "binding.h"
#include "panels.h"

// x: [M, K]; panels: [num_panels][K][P] fp32 (panels.pack); bias: [N] (read only with has_bias);
// out: [M, N]. The panels one at a time, in order, to whichever thread is
// free (module docstring)
static void kernel(const float* x, const float* panels, const float* bias, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias, int64_t threads) {
  if (!has_bias) bias = nullptr;
  const int64_t num_panels = (N + P - 1) / P;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t p = 0; p < num_panels; ++p) {
    const float* panel = panels + p * K * P;
    for_blocks(p, M, N, bias, out, [&](int64_t j0, int64_t m0, int64_t r, float* o, int64_t cols, const float* b) {
      with_count<MB>(r, [&](auto R) { tile<R()>(x + m0 * K, K, panel, j0, o, N, cols, b); });
    });
  }
}

PDSERVE_MODULE(kernel)
