// fused.py: rotary
#include "binding.h"
#include "fused.h"

#ifndef PD_PARALLEL_ROWS
#error "build.py gives PD_PARALLEL_ROWS (fused.PARALLEL_ROWS)"
#endif
// batches of at least this many rows split their rows over the threads
#define PARALLEL_ROWS PD_PARALLEL_ROWS

// x: [rows, heads, d] with rows ld floats apart (heads contiguous); cos, sin: [rows, d]; out:
// [rows, heads, d] contiguous. out = x * cos + rotate_half(x) * sin, rotate_half(x) being
// (-x[half:], x[:half]): each product and the sum rounded once, as aten's neg, mul and add
static void kernel(const float* x, const float* cos, const float* sin, float* out, int64_t rows,
                       int64_t ld, int64_t heads, int64_t d, int64_t threads) {
  const int64_t half = d / 2;
  const int64_t whole = half % 16 == 0 ? half : 0;
  const int64_t nt = rows >= PARALLEL_ROWS ? threads : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t m = 0; m < rows; ++m) {
    const float* c = cos + m * d;
    const float* s = sin + m * d;
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* a = x + m * ld + hd * d;  // first half a[e], second half a[half + e]
      float* o = out + (m * heads + hd) * d;
      for (int64_t e = 0; e < whole; e += 16) {
        const vf16 lo = load<vf16>(a + e), hi = load<vf16>(a + half + e);
        store<vf16>(o + e, lo * load<vf16>(c + e) + (-hi) * load<vf16>(s + e));
        store<vf16>(o + half + e, hi * load<vf16>(c + half + e) + lo * load<vf16>(s + half + e));
      }
      for (int64_t e = whole; e < half; ++e) {
        const float lo = a[e], hi = a[half + e];
        o[e] = lo * c[e] + (-hi) * s[e];
        o[half + e] = hi * c[half + e] + lo * s[half + e];
      }
    }
  }
}

PDSERVE_MODULE(kernel)
