// fused.py: argmax
#include "binding.h"
#include "fused.h"

// out[m] = the first index of row m's largest value, or of its first NaN (aten's argmax:
// NaN is the largest; -0 equals +0; a row of -inf gives 0)
typedef int32_t vi16 __attribute__((vector_size(64)));

static int64_t argmax_row(const float* __restrict__ x, int64_t v) {
  const int64_t whole = v / 16 * 16;
  vf16 best;
  vi16 at, lane, nan = {};
  for (int l = 0; l < 16; ++l) best[l] = -INFINITY, at[l] = 0, lane[l] = l;
  for (int64_t e = 0; e < whole; e += 16) {  // per lane: its largest value, first where it is
    const vf16 a = load<vf16>(x + e);
    const vi16 more = a > best;
    best = more ? a : best;
    at = more ? lane + (int32_t)e : at;
    nan |= a != a;
  }
  float top = -INFINITY;
  for (int l = 0; l < 16; ++l) top = best[l] > top ? best[l] : top;
  int64_t index = 0;
  bool found = false;
  for (int l = 0; l < 16; ++l)
    if (whole > 0 && best[l] == top && (!found || at[l] < index)) index = at[l], found = true;
  bool any_nan = false;
  for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
  for (int64_t e = whole; e < v; ++e) {
    any_nan |= x[e] != x[e];
    if (x[e] > top || (!found && x[e] == top)) top = x[e], index = e, found = true;
  }
  if (any_nan) {
    for (int64_t e = 0; e < v; ++e)
      if (x[e] != x[e]) return e;
  }
  return index;
}

// logits: [rows, v], rows ld floats apart; out: [rows] int64
static void kernel(const float* logits, int64_t* out, int64_t rows, int64_t v, int64_t ld, int64_t threads) {
  const int64_t nt = rows > 1 ? (threads < rows ? threads : rows) : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t m = 0; m < rows; ++m) out[m] = argmax_row(logits + m * ld, v);
}

PDSERVE_MODULE(kernel)
