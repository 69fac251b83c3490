// fused.py: kv_write
#include "binding.h"
#include "fused.h"

// cache: [2, slots, row] (K plane, then V); k, v: [rows, row] with rows ldk / ldv floats apart.
// Row t goes to slot slots[t] of each plane; a slot out of range is skipped and counted in bad[0].
static void kernel(float* cache, const int64_t* slots, const float* k, const float* v, int64_t* bad,
                       int64_t rows, int64_t row, int64_t num_slots, int64_t ldk, int64_t ldv) {
  float* vplane = cache + num_slots * row;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) { ++bad[0]; continue; }
    __builtin_memcpy(cache + s * row, k + t * ldk, row * sizeof(float));
    __builtin_memcpy(vplane + s * row, v + t * ldv, row * sizeof(float));
  }
}

PDSERVE_MODULE(kernel)
