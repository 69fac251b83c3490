// The headers the larger kernels share, included first by each of them (panels.cpp,
// panels_coded.cpp, amx.cpp, paged.cpp, prefill.cpp, fused_swiglu.cpp), with angle brackets:
// build.py's precompiled copy (pdserve_prelude.h.gch, in a directory ahead of this one on the
// include path, made once per machine with the kernels' flags) is then read instead of parsing
// them (at::vec alone is 2 s of a kernel's 3 s compile); where it is missing or was made with
// other flags, GCC reads this file (-Winvalid-pch says so in a verbose build). The small fused
// kernels parse what they include faster than they would load this.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

// at::vec: torch's vector classes (Vectorized<float>: Sleef's exp, fmadd, reductions)
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
