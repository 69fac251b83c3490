// fused.py: token bitmask (structured outputs: workers/engine/structured.py)
#include "binding.h"
#include "fused.h"

// For each listed row r: logits[r, t] = -inf where bit t % 32 of word t / 32 of bitmask[r] is
// clear (t < vocab), and for every t in [vocab, width) (padding past the grammar's vocabulary).
// A word of all ones (inside a JSON string, most of them) is skipped; one of all zeros (most
// words elsewhere) is a run of stores.
static void kernel(float* logits, const int32_t* bitmask, const int64_t* rows, int64_t n, int64_t width,
                   int64_t vocab, int64_t ld, int64_t words, int64_t threads) {
  const int64_t nt = n > 1 ? (threads < n ? threads : n) : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* __restrict__ x = logits + rows[i] * ld;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + rows[i] * words);
    const int64_t last = vocab < width ? vocab : width;
    for (int64_t w = 0; w * 32 < last; ++w) {
      const uint32_t m = mask[w];
      if (m == 0xffffffffu) continue;
      const int64_t start = w * 32;
      const int64_t stop = start + 32 < last ? start + 32 : last;
      if (m == 0) {
        for (int64_t t = start; t < stop; ++t) x[t] = -INFINITY;
      } else {
        for (int64_t t = start; t < stop; ++t)
          if (!((m >> (t - start)) & 1u)) x[t] = -INFINITY;
      }
    }
    for (int64_t t = last; t < width; ++t) x[t] = -INFINITY;
  }
}

PDSERVE_MODULE(kernel)
