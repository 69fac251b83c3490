// What the fused kernels (fused_*.cpp, fused.py) share: GCC vector types of 8 and 16 floats
// (held in registers; each lane's arithmetic one rounding, as aten's), and unaligned loads and
// stores of them.
#pragma once

#include <math.h>
#include <omp.h>

#include <cstdint>

// load returns a vf16 by value: on an AVX2 build GCC notes that such a function's ABI differs
// without AVX-512; it is static and inlined, never called across an ABI boundary
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));

template <typename vec>
static inline vec load(const float* p) { vec v; __builtin_memcpy(&v, p, sizeof(vec)); return v; }
template <typename vec>
static inline void store(float* p, const vec& v) { __builtin_memcpy(p, &v, sizeof(vec)); }
