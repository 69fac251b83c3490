"""The linears of small batches on CPU (fp32): one hand-written C++ kernel on a panel copy of
each weight.

A decode step multiplies every weight by a few rows, one per sequence: its time goes to
reading the weights from memory (SmolLM2: 538 MB a step, each byte once), yet neither of
torch's GEMMs streams them at the memory's speed there. On the Zen 4 VM (BENCHMARKS.md, "the
decode step's linears on a hand-written panel kernel"), oneDNN's inner product on its packed
copy read SmolLM2's linears at 20-25 GB/s at 1-8 rows, slowest on the narrow ones (q/k/v, o:
12-17 GB/s inside a step), and ``F.linear`` (MKL, the plain weight) at 8-12 GB/s; this kernel
reads them at 31-39 GB/s at 1-8 rows (1.1-1.9x oneDNN's speed at 1-64 rows; at 256, a prompt's
rows, oneDNN is 1.3x faster).

The layout: the weight ``[N, K]`` cut into panels of ``PANEL`` output rows, each stored
transposed, ``[K, PANEL]`` contiguous (``pack``; the last panel padded with zeros), so that
one panel is one sequential stream. The kernel: the threads take the panels one at a time, in
order (OpenMP's dynamic schedule: the two threads read neighbouring panels, and a thread that
the OS preempts for the serving path's work does not hold the others up until it is back, as a
fixed split would; alone, 14.6 against 17.3 ms at one row). For a block of up to ``MB`` input
rows and ``JB`` vectors of a panel's columns it keeps ``MB x JB`` accumulators in vector
registers (24 of AVX-512's 32; 12 of AVX2's 16) and, for each ``k``, loads the panel's ``JB``
vectors once, broadcasts each row's ``x[m, k]`` and adds their products (fused multiply-add).
Nothing is reduced across lanes and no accumulator leaves the registers until the panel's ``K``
are done. Wider batches take their rows ``MB`` at a time over a panel that stays in L2. The
first version, on ``at::vec::Vectorized`` arrays, kept its accumulators on the stack (g++
spilled them: 57 % of the FMA peak at best); this one holds GCC vector types, which stay in registers.

Each output is the same sequence of operations on its own input row and weight row, whatever
the batch size, the row block or the thread: a row's result does not depend on the batch
around it, and a fused q/k/v weight gives the separate layers' outputs bit for bit. The
summation order (k ascending, one FMA each: AVX-512 and AVX2 give the same bits) is not MKL's
nor oneDNN's, which differ from each other in the last bits too; the engine's greedy parity with
transformers is held by its tests on this path. Up to how many rows it is taken is timed at load against oneDNN
(``workers/models/parallel.py``, ``choose_plain_rows``); oneDNN keeps prompt chunks and wide
batches, where it runs at the FMA peak and this kernel does not.

Built once per process through inductor's C++ toolchain (``CppPythonBindingsCodeCache``: its
compiler, flags, OpenMP and vector ISA, and its on-disk cache), as ``cpu_paged`` is; where it
cannot be built, the small batches keep ``F.linear`` (``available`` says which).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

PANEL = 48  # output rows per panel: 3 AVX-512 vectors, 6 AVX2 ones
MAX_ROWS = 64  # the widest batch the kernel takes (oneDNN wins from some width up: timed at load)

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// the widest vector the build may use (16 floats: AVX-512; tests narrow it to cover the others)
#define MAX_VL {max_vl}
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
static inline vf fmadd(vf a, vf b, vf c) {  // inductor builds with -ffp-contract=off: fuse explicitly
#if defined(VEC_AVX512)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(VEC_AVX2)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

constexpr int P = {panel};               // panel width (floats)
constexpr int JV = P / VL;               // vectors across a panel
constexpr int JB = JV < 3 ? JV : 3;      // vectors per block
constexpr int MB = VL >= 16 ? 8 : 4;     // input rows per block
static_assert(JV % JB == 0, "a panel is whole blocks");

// out[m][j0 .. j0 + JB*VL) of rows 0..R-1 for one panel (w: the panel, [K][P]); cols: how many
// of the block's columns exist (the last panel's padding is not written).
template <int R>
static inline void tile(const float* __restrict__ x, int64_t K, const float* __restrict__ w,
                        int64_t j0, float* __restrict__ out, int64_t ldo, int64_t cols,
                        const float* __restrict__ bias) {
  vf acc[R][JB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < JB; ++j) acc[r][j] = vf{};
  const float* wk = w + j0;
  for (int64_t k = 0; k < K; ++k, wk += P) {
    vf wv[JB];
    for (int j = 0; j < JB; ++j) wv[j] = load(wk + j * VL);
    for (int r = 0; r < R; ++r) {
      const vf xb = vf{} + x[r * K + k];
      for (int j = 0; j < JB; ++j) acc[r][j] = fmadd(xb, wv[j], acc[r][j]);
    }
  }
  if (bias) {
    alignas(64) float b[JB * VL] = {};
    for (int64_t c = 0; c < cols; ++c) b[c] = bias[c];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) acc[r][j] += load(b + j * VL);
  }
  if (cols == JB * VL) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) store(out + r * ldo + j * VL, acc[r][j]);
  } else {
    alignas(64) float t[JB * VL];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < JB; ++j) store(t + j * VL, acc[r][j]);
      for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = t[c];
    }
  }
}

static void block(int64_t r, const float* x, int64_t K, const float* w, int64_t j0, float* out,
                  int64_t ldo, int64_t cols, const float* bias) {
  switch (r) {
    case 1: tile<1>(x, K, w, j0, out, ldo, cols, bias); break;
    case 2: tile<2>(x, K, w, j0, out, ldo, cols, bias); break;
    case 3: tile<3>(x, K, w, j0, out, ldo, cols, bias); break;
    case 4: tile<4>(x, K, w, j0, out, ldo, cols, bias); break;
    case 5: tile<5>(x, K, w, j0, out, ldo, cols, bias); break;
    case 6: tile<6>(x, K, w, j0, out, ldo, cols, bias); break;
    case 7: tile<7>(x, K, w, j0, out, ldo, cols, bias); break;
    case 8: tile<8>(x, K, w, j0, out, ldo, cols, bias); break;
  }
}

extern "C" void kernel(const float* x, const float* panels, const float* bias, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias, int64_t threads) {
  if (!has_bias) bias = nullptr;
  const int64_t num_panels = (N + P - 1) / P;
  // panels one at a time, in order, to whichever thread is free (module docstring)
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t p = 0; p < num_panels; ++p) {
    const float* w = panels + p * K * P;
    for (int64_t j0 = 0; j0 < P; j0 += JB * VL) {
      const int64_t col0 = p * P + j0;
      if (col0 >= N) break;
      const int64_t cols = N - col0 < JB * VL ? N - col0 : JB * VL;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {  // wider batches: MB rows at a time, the panel in L2
        const int64_t r = M - m0 < MB ? M - m0 : MB;
        block(r, x + m0 * K, K, w, j0, out + m0 * N + col0, N, cols, bias ? bias + col0 : nullptr);
      }
    }
  }
}
"""

ARGTYPES = [
    "const float*",  # x [M, K]
    "const float*",  # panels [ceil(N / PANEL), K, PANEL]
    "const float*",  # bias [N] (read only with has_bias)
    "float*",  # out [M, N]
    "int64_t",  # M
    "int64_t",  # N
    "int64_t",  # K
    "int64_t",  # has_bias
    "int64_t",  # threads
]


@functools.cache
def build(max_vector_floats: int = 16) -> Any:
    """The kernel compiled for this CPU, using vectors of at most ``max_vector_floats`` floats
    (16: AVX-512 where the CPU has it; 8: AVX2 + FMA; 4: plain vector code). Below 16 only for
    the tests, which check each path this CPU can run."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = _SOURCE.replace("{panel}", str(PANEL)).replace("{max_vl}", str(max_vector_floats))
    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, source)


@functools.cache
def available() -> bool:
    """Whether the kernel builds here (asked once per process; a failure is logged and the
    small batches keep ``F.linear``)."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - no compiler, an inductor without this API ...
        logger.warning("the CPU panel kernel for small batches did not build (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The panel copy of an fp32 ``weight`` ``[N, K]``: ``[ceil(N / PANEL), K, PANEL]``, each
    panel ``PANEL`` output rows transposed, the last one padded with zeros."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    with torch.no_grad():
        padded = weight.new_zeros(num_panels * PANEL, k)
        padded[:n] = weight
        return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


def takes(x: torch.Tensor) -> bool:
    """Whether ``linear`` takes ``x``: fp32 on CPU, 1..``MAX_ROWS`` rows, outside
    ``torch.compile`` (a graph keeps ``F.linear``)."""
    k = x.shape[-1]
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and k > 0
        and 0 < x.numel() // k <= MAX_ROWS
        and not torch.compiler.is_compiling()
    )


def linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None, kernel: Any = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``pack(weight)``, for ``x`` ``[..., K]`` that
    ``takes`` accepts: ``[..., out_features]``. ``kernel``: a ``build`` (default: this CPU's)."""
    k = panels.shape[1]
    rows = x.numel() // k
    x2 = x.reshape(rows, k).contiguous()  # a no-op where it already is
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    (kernel or build())(
        x2,
        panels,
        bias if bias is not None else panels,  # any fp32 tensor: not read without a bias
        out,
        rows,
        out_features,
        k,
        int(bias is not None),
        torch.get_num_threads(),
    )
    return out
