// The vector type and its few operations, shared by the panel kernels (panels.h) and the prompt
// attention kernel (prefill.cpp).
#pragma once

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

#ifndef PD_MAX_VL
#error "build.py gives PD_MAX_VL (the widest vector, in floats, the build may use)"
#endif

// the widest vector the build may use (16 floats: AVX-512; tests narrow it to cover the others)
#define MAX_VL PD_MAX_VL
#if defined(__AVX512F__) && MAX_VL >= 16
#define VEC_AVX512 1
constexpr int VL = 16;
#elif defined(__AVX2__) && defined(__FMA__) && MAX_VL >= 8
#define VEC_AVX2 1
constexpr int VL = 8;
#else
constexpr int VL = 4;  // plain vector code: what the compiler makes of it (SSE, NEON, ...)
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf load(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof(vf)); return v; }
static inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }
static inline vf bcast(float v) {  // not vf{} + v: adding 0.0 is an instruction under -ffp-contract=off
#if defined(VEC_AVX512)
  return (vf)_mm512_set1_ps(v);
#elif defined(VEC_AVX2)
  return (vf)_mm256_set1_ps(v);
#else
  vf b;
  for (int i = 0; i < VL; ++i) b[i] = v;
  return b;
#endif
}
static inline vf fmadd(vf a, vf b, vf c) {  // inductor builds with -ffp-contract=off: fuse explicitly
#if defined(VEC_AVX512)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(VEC_AVX2)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// f(std::integral_constant<int, C>) for C = c, 1 <= c <= N: a count (of rows, of vectors) as a
// template argument, so that a tile's accumulators are an array the compiler keeps in registers
template <int N, class F>
static inline void with_count(int64_t c, F&& f) {
  if constexpr (N > 1) {
    if (c < N) {
      with_count<N - 1>(c, f);
      return;
    }
  }
  f(std::integral_constant<int, N>{});
}
