"""Small CPU (fp32) steps of the engine, one C++ call each instead of several aten ops, bit for
bit what those ops compute: the residual add with the RMSNorm after it (``add_rms_norm``),
rotary position embedding (``rotary``), the KV cache write of K and V (``kv_write``) and the
greedy sampler's argmax (``argmax``).

Eager, ``F.rms_norm`` is a composite of seven aten ops on CPU (``pow``, ``sum`` and ``div_`` for
the mean, ``add_``, ``rsqrt``, two ``mul``), the decoder adds the residual before each norm (one
more op), rotary embedding is five (``neg``, ``cat``, two ``mul``, ``add``) and the KV write two
``index_copy_``. A decode step at batch 8 runs 61 norms, 60 adds, 30 rotations and 30 writes on
tensors of a few KB (SmolLM2): each op is a dispatch, an allocation and a pass over memory
(~25-30 us a norm or a rotation). aten's ``argmax`` reads 0.4-0.8 G values a second here: 0.5 ms
for 8 rows of SmolLM2's 49152 logits. In the engine's c8 workload (BENCHMARKS.md, seventh
session) the norms with their adds were a quarter of the time the profiler saw in aten ops;
with all four kernels the engine ran it 1.17x faster (``bench/elementwise.py``).

**The norm.** ``add_rms_norm`` writes ``h = x + residual`` and ``w * (h * r)`` with
``r = 1 / sqrt(mean(h * h) + eps)`` for each row, in one call. To stay exact it does each
operation as aten does:

- ``h + residual``, ``h * h``, ``h * r`` and ``w * (h * r)`` are elementwise, one rounding each
  (built with ``-ffp-contract=off``: no fused multiply-add; the products commute bit for bit);
- the mean is aten's ``sum`` then ``div_`` by the row length, and the sum follows aten's order
  for a contiguous inner reduction (``vectorized_inner_sum`` in ``SumKernel.cpp``): the row cut
  into vectors of ``W`` floats, summed lane by lane in four interleaved rows through
  ``multi_row_sum``'s cascade of levels, the four rows added in order, the scalar tail past the
  last whole vector summed apart, then the lanes added into it one by one. ``W`` is found, not
  assumed: torch 2.13's sum adds 8-float vectors on this AVX-512 CPU as on AVX2 (with 16, only
  11-16 of 30 random rows matched);
- ``rsqrt`` is ``1 / sqrt`` (both of aten's paths, vector and scalar).

**Rotary embedding** (``rotary``): ``x * cos + rotate_half(x) * sin`` per element, the negation
and both products rounded as aten rounds them, read from a strided view (the fused q/k/v
output's q and k heads) and written contiguous.

**The KV write and the argmax** copy rows (a slot out of range raises ``IndexError``, as
``index_copy_`` does) and pick, per row, the first index of the largest value, NaN counting as
largest and -0 equal to +0, as aten's ``argmax`` does (each vector lane keeps its first largest
value and where it is; the lanes then give the smallest such index).

**Checked, not trusted.** ``norm_width`` tries each vector width against ``F.rms_norm``,
``rotary_usable`` the rotation against the eager ops and ``argmax_usable`` the argmax against
aten's (ties, NaN, infinities, signed zeros), bit for bit, once per process (row lengths with
and without a tail, row counts on both sides of the threads' split) before the engine uses
them; a difference, or a build that fails, leaves aten's ops, and the log says why.
Rows are independent, so the threads split the rows of a wide batch with the same bits.

Built through inductor's C++ toolchain, as ``cpu_linear`` is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PARALLEL_ROWS = 64  # batches of at least this many rows split their rows over the threads
NORM_WIDTHS = (8, 16)  # the vector widths (floats) tried for aten's order of sums
# aten's elementwise loops run tensors below this many elements (at::internal::GRAIN_SIZE) in one
# serial pass; the SwiGLU kernel copies that pass's split between vector and scalar exp
SWIGLU_MAX_ELEMENTS = 32768
NORM_MIN = 64  # narrower rows keep F.rms_norm (aten sums rows shorter than a vector another way)
enabled = True  # False: the model runs aten's ops (bench/elementwise.py's baseline, in one process)

_PRELUDE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <omp.h>
#include <math.h>

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));

template <typename vec>
static inline vec load(const float* p) { vec v; __builtin_memcpy(&v, p, sizeof(vec)); return v; }
template <typename vec>
static inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }
"""

_NORM_SOURCE = (
    _PRELUDE
    + r"""
static inline int64_t ceil_log2(int64_t x) {  // aten's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll((uint64_t)(x - 1));
}

// aten's sum of a contiguous row of V-float vectors (vectorized_inner_sum -> row_sum ->
// multi_row_sum with 4 interleaved rows and 4 levels), over the squares of h; each lane is its
// own chain of additions, so GCC's vector types (held in registers) keep aten's order
template <typename vec, int V>
static float sum_squares(const float* __restrict__ h, int64_t n) {
  auto sq = [&](int64_t v) { const vec a = load<vec>(h + v * V); return a * a; };
  const int64_t vec_size = n / V;
  const int64_t size_ilp = vec_size / 4;
  vec acc[4][4] = {};
  const int64_t level_power = ceil_log2(size_ilp) / 4 > 4 ? ceil_log2(size_ilp) / 4 : 4;
  const int64_t level_step = (int64_t)1 << level_power;
  const int64_t level_mask = level_step - 1;
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += sq(i * 4 + k);
    for (int64_t j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = vec{};
      }
      const int64_t mask = level_mask << (j * level_power);
      if ((i & mask) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += sq(i * 4 + k);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  // row_sum: the vectors past the last group of four go into the first row, then the rows add up
  for (int64_t v = size_ilp * 4; v < vec_size; ++v) acc[0][0] += sq(v);
  for (int k = 1; k < 4; ++k) acc[0][0] += acc[0][k];
  // vectorized_inner_sum: the scalar tail first, then the lanes in order
  float total = 0.0f;
  for (int64_t e = vec_size * V; e < n; ++e) total += h[e] * h[e];
  for (int l = 0; l < V; ++l) total += acc[0][0][l];
  return total;
}

// elementwise work in 16-float vectors (each lane one rounding, as aten's), then a scalar tail
template <typename vec, int V>
static void norm_row(const float* __restrict__ x, const float* __restrict__ res, float* __restrict__ hout,
                     const float* __restrict__ w, float* __restrict__ out, int64_t n, float eps) {
  const int64_t whole = n / 16 * 16;
  const float* h = x;
  if (res != nullptr) {
    for (int64_t e = 0; e < whole; e += 16) store<vf16>(hout + e, load<vf16>(x + e) + load<vf16>(res + e));
    for (int64_t e = whole; e < n; ++e) hout[e] = x[e] + res[e];
    h = hout;
  }
  float var = sum_squares<vec, V>(h, n) / (float)n;
  var = var + eps;
  const float r = 1.0f / sqrtf(var);
  for (int64_t e = 0; e < whole; e += 16) store<vf16>(out + e, load<vf16>(w + e) * (load<vf16>(h + e) * r));
  for (int64_t e = whole; e < n; ++e) out[e] = w[e] * (h[e] * r);
}

// x, residual, h: [rows, n] contiguous (residual and h unused without has_residual); out [rows, n]
extern "C" void kernel(const float* x, const float* residual, float* h, const float* weight, float* out,
                       int64_t rows, int64_t n, int64_t has_residual, float eps, int64_t width,
                       int64_t threads) {
  const int64_t nt = rows >= PARALLEL_ROWS ? threads : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t m = 0; m < rows; ++m) {
    const float* res = has_residual ? residual + m * n : nullptr;
    float* hm = has_residual ? h + m * n : nullptr;
    if (width == 16) norm_row<vf16, 16>(x + m * n, res, hm, weight, out + m * n, n, eps);
    else norm_row<vf8, 8>(x + m * n, res, hm, weight, out + m * n, n, eps);
  }
}
"""
)

NORM_ARGTYPES = [
    "const float*",  # x [rows, n]
    "const float*",  # residual [rows, n] (read only with has_residual)
    "float*",  # h = x + residual [rows, n] (written only with has_residual)
    "const float*",  # weight [n]
    "float*",  # out [rows, n]
    "int64_t",  # rows
    "int64_t",  # n
    "int64_t",  # has_residual
    "float",  # eps (aten adds it to the fp32 mean as an fp32 number)
    "int64_t",  # width: the vector width (floats) of aten's sums
    "int64_t",  # threads
]


_ROTARY_SOURCE = (
    _PRELUDE
    + r"""
// x: [rows, heads, d] with rows ld floats apart (heads contiguous); cos, sin: [rows, d]; out:
// [rows, heads, d] contiguous. out = x * cos + rotate_half(x) * sin, rotate_half(x) being
// (-x[half:], x[:half]): each product and the sum rounded once, as aten's neg, mul and add
extern "C" void kernel(const float* x, const float* cos, const float* sin, float* out, int64_t rows,
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
"""
)

ROTARY_ARGTYPES = [
    "const float*",  # x [rows, heads, d], rows ld floats apart
    "const float*",  # cos [rows, d]
    "const float*",  # sin [rows, d]
    "float*",  # out [rows, heads, d]
    "int64_t",  # rows
    "int64_t",  # ld
    "int64_t",  # heads
    "int64_t",  # d
    "int64_t",  # threads
]


_ARGMAX_SOURCE = (
    _PRELUDE
    + r"""
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

extern "C" void kernel(const float* logits, int64_t* out, int64_t rows, int64_t v, int64_t ld, int64_t threads) {
  const int64_t nt = rows > 1 ? (threads < rows ? threads : rows) : 1;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t m = 0; m < rows; ++m) out[m] = argmax_row(logits + m * ld, v);
}
"""
)

ARGMAX_ARGTYPES = [
    "const float*",  # logits [rows, v], rows ld floats apart
    "int64_t*",  # out [rows]
    "int64_t",  # rows
    "int64_t",  # v
    "int64_t",  # ld
    "int64_t",  # threads
]


_KV_WRITE_SOURCE = (
    _PRELUDE
    + r"""
// cache: [2, slots, row] (K plane, then V); k, v: [rows, row] with rows ldk / ldv floats apart.
// Row t goes to slot slots[t] of each plane; a slot out of range is skipped and counted in bad[0].
extern "C" void kernel(float* cache, const int64_t* slots, const float* k, const float* v, int64_t* bad,
                       int64_t rows, int64_t row, int64_t num_slots, int64_t ldk, int64_t ldv) {
  float* vplane = cache + num_slots * row;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) { ++bad[0]; continue; }
    __builtin_memcpy(cache + s * row, k + t * ldk, row * sizeof(float));
    __builtin_memcpy(vplane + s * row, v + t * ldv, row * sizeof(float));
  }
}
"""
)

KV_WRITE_ARGTYPES = [
    "float*",  # cache [2, num_slots, row]
    "const int64_t*",  # slots [rows]
    "const float*",  # k [rows, row], rows ldk floats apart
    "const float*",  # v [rows, row], rows ldv floats apart
    "int64_t*",  # bad [1]: slots out of range (skipped)
    "int64_t",  # rows
    "int64_t",  # row: floats a slot holds in one plane (heads x dim)
    "int64_t",  # num_slots
    "int64_t",  # ldk
    "int64_t",  # ldv
]


_SWIGLU_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>

// gu: [rows, 2 * inner], rows ld floats apart: the gate's columns, then the up projection's;
// out: [rows, inner] contiguous. out = silu(gate) * up, silu as aten's silu_kernel computes it
// on a contiguous inner loop: at::vec's x / (1 + exp(-x)) (Sleef's vector exp) for two vectors at
// a time, then x / (1 + std::exp(-x)) for the tail past the last pair (Loops.h's
// vectorized_loop, then basic_loop); the product rounded once, as aten's mul
extern "C" void kernel(const float* gu, float* out, int64_t rows, int64_t inner, int64_t ld) {
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
"""

SWIGLU_ARGTYPES = [
    "const float*",  # gu [rows, 2 * inner], rows ld floats apart
    "float*",  # out [rows, inner]
    "int64_t",  # rows
    "int64_t",  # inner
    "int64_t",  # ld
]


_KERNELS = {  # name: (argument types, source)
    "norm": (NORM_ARGTYPES, _NORM_SOURCE),
    "rotary": (ROTARY_ARGTYPES, _ROTARY_SOURCE),
    "argmax": (ARGMAX_ARGTYPES, _ARGMAX_SOURCE),
    "kv_write": (KV_WRITE_ARGTYPES, _KV_WRITE_SOURCE),
    "swiglu": (SWIGLU_ARGTYPES, _SWIGLU_SOURCE),
}


@functools.cache
def build(kernel: str) -> Any:
    """``kernel`` (a ``_KERNELS`` name) compiled for this CPU, once per process (inductor's on-disk
    cache keeps it between processes)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    argtypes, source = _KERNELS[kernel]
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source.replace("PARALLEL_ROWS", str(PARALLEL_ROWS)))


def _checked(kernel: str, what: str, stays: str, check: Callable[[], str | None] = lambda: None) -> bool:
    """Whether ``kernel`` builds here and ``check`` finds no difference from aten (None), asked
    once per process by each kernel's ``*_usable``; a failure is logged and ``stays`` runs."""
    try:
        build(kernel)
        why = check()
    except Exception as exc:  # noqa: BLE001 - no compiler, an inductor without this API ...
        logger.warning("the %s kernel did not build (%s: %s); %s stays", what, type(exc).__name__, exc, stays)
        return False
    if why is not None:
        logger.warning("the %s kernel is not used: %s", what, why)
        return False
    return True


def _cpu_fp32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


# ---------------------------------------------------------------------------------- the norm
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, F.rms_norm(h, weight, eps))`` with ``h = x + residual`` (``x`` itself without a
    residual), for contiguous fp32 ``x`` (and ``residual``) ``[..., n]`` and ``weight`` ``[n]``
    (``norm_takes``). ``width``: the vector width of the sums (default: ``norm_width()``)."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    build("norm")(
        x,
        residual if residual is not None else x,  # any fp32 tensor: not read without a residual
        h,
        weight,
        out,
        x.numel() // n,
        n,
        int(residual is not None),
        float(eps),
        width or norm_width(),
        torch.get_num_threads(),
    )
    return h, out


def _norm_check(width: int) -> str | None:
    """Why the kernel at ``width`` differs from aten's add and ``F.rms_norm`` here (None: it does not)."""
    gen = torch.Generator().manual_seed(0)
    for n in (576, 64, 100, 2048, 4096 + 24):
        for rows in (1, 3, PARALLEL_ROWS + 1):
            x = torch.randn(rows, n, generator=gen) * 3.0
            res = torch.randn(rows, n, generator=gen)
            w = torch.rand(n, generator=gen) + 0.5
            h, ours = add_rms_norm(x, res, w, 1e-5, width)
            ref = F.rms_norm(x + res, (n,), w, 1e-5)
            if not torch.equal(h, x + res) or not torch.equal(ours, ref):
                return f"rows {rows}, width {n}: up to {(ours - ref).abs().max().item():.3g} from F.rms_norm"
    return None


@functools.cache
def norm_width() -> int | None:
    """The vector width (floats) at which the kernel's sums equal aten's on this CPU, tried
    against ``F.rms_norm`` bit for bit once per process; None where the kernel does not build or
    no width matches (logged: the model keeps aten's ops)."""
    try:
        build("norm")
        whys = {width: _norm_check(width) for width in NORM_WIDTHS}
    except Exception as exc:  # noqa: BLE001 - no compiler, an inductor without this API ...
        logger.warning("the fused RMSNorm kernel did not build (%s: %s); F.rms_norm stays", type(exc).__name__, exc)
        return None
    for width, why in whys.items():
        if why is None:
            return width
    logger.warning(
        "the fused RMSNorm kernel is not used (torch's CPU capability %s): %s",
        torch.backends.cpu.get_cpu_capability(),
        "; ".join(f"{width}-float vectors: {why}" for width, why in whys.items()),
    )
    return None


def norm_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``add_rms_norm`` runs for these tensors (CPU fp32, contiguous, eager, checked here)."""
    return (
        enabled
        and _cpu_fp32(x, weight, residual)
        and x.shape[-1] >= NORM_MIN
        and x.is_contiguous()
        and (residual is None or residual.is_contiguous())
        and not torch.compiler.is_compiling()
        and norm_width() is not None
    )


# ---------------------------------------------------------------------------------- rotary
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for fp32 ``x`` ``[T, heads, D]`` (its heads contiguous,
    its rows any stride apart) and ``cos``/``sin`` ``[T, 1, D]`` contiguous: ``[T, heads, D]``."""
    rows, heads, d = x.shape
    out = torch.empty(rows, heads, d, dtype=torch.float32)
    build("rotary")(x, cos, sin, out, rows, x.stride(0), heads, d, torch.get_num_threads())
    return out


def eager_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Transformers' rotary arithmetic in aten ops, ``x * cos + rotate_half(x) * sin``: what the
    model runs where ``rotary`` does not, and what ``rotary`` is checked against."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotary_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    for d in (64, 128, 40):
        for rows in (1, 3, PARALLEL_ROWS + 1):
            wide = torch.randn(rows, 5, d, generator=gen) * 4.0
            x = wide[:, 1:4]  # a strided view, as the fused q/k/v output's heads
            angles = torch.rand(rows, 1, d, generator=gen) * 100.0
            cos, sin = angles.cos(), angles.sin()
            if not torch.equal(rotary(x, cos, sin), eager_rotary(x, cos, sin)):
                return f"head dim {d}, {rows} rows differ from aten's"
    return None


@functools.cache
def rotary_usable() -> bool:
    """Whether the rotary kernel builds here and equals ``eager_rotary`` bit for bit."""
    return _checked("rotary", "fused rotary", "aten's rotation", _rotary_check)


def rotary_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary`` runs for these tensors (CPU fp32, heads contiguous, eager, checked here)."""
    return (
        enabled
        and _cpu_fp32(x, cos, sin)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
        and not torch.compiler.is_compiling()
        and rotary_usable()
    )


# ---------------------------------------------------------------------------------- argmax
def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 ``logits`` ``[N, V]`` (rows any stride apart): ``[N]``
    int64. aten's argmax reads ~0.4 G values a second here (1 ms for 8 rows of SmolLM2's 49152)."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    build("argmax")(logits, out, rows, v, logits.stride(0), torch.get_num_threads())
    return out


def _argmax_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    for v in (49152, 100, 7, 16):
        rows = torch.randn(6, v, generator=gen)
        rows[1] = rows[1].round()  # ties: the first index wins
        rows[2, v // 3] = float("nan")
        rows[2, v // 2] = float("nan")
        rows[3] = float("-inf")
        rows[4, v - 1] = float("inf")
        rows[5] = 0.0
        rows[5, v // 2 :] = -0.0
        for view in (rows, torch.cat([rows, rows], dim=1)[:, :v]):
            if not torch.equal(argmax(view), view.argmax(dim=-1)):
                return f"{v} values a row differ from aten's"
    return None


@functools.cache
def argmax_usable() -> bool:
    """Whether the argmax kernel builds here and picks aten's index on rows with ties, NaN,
    infinities and signed zeros."""
    return _checked("argmax", "argmax", "aten's argmax", _argmax_check)


def argmax_takes(logits: torch.Tensor) -> bool:
    """Whether ``argmax`` runs for these logits (CPU fp32 ``[N, V]``, each row contiguous, eager)."""
    return (
        enabled
        and _cpu_fp32(logits)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and not torch.compiler.is_compiling()
        and argmax_usable()
    )


# ---------------------------------------------------------------------------------- KV write
def kv_write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``cache[0, slots] = k`` and ``cache[1, slots] = v`` in one call, for an fp32 layer cache
    viewed ``[2, num_slots, heads, dim]`` (contiguous), int64 ``slots`` ``[T]`` and ``k``/``v``
    ``[T, heads, dim]`` (heads contiguous, rows any stride apart: the fused q/k/v output's). A
    slot out of range raises ``IndexError``, as ``index_copy_`` does (the others are written)."""
    rows, heads, dim = k.shape
    bad = torch.zeros(1, dtype=torch.long)
    build("kv_write")(cache, slots, k, v, bad, rows, heads * dim, cache.shape[1], k.stride(0), v.stride(0))
    check_slots(bad, slots, cache.shape[1])


def check_slots(bad: torch.Tensor, slots: torch.Tensor, num_slots: int) -> None:
    """Raise ``IndexError`` as ``index_copy_`` does where the kernel counted slots out of range
    in ``bad`` (the others are written)."""
    if bad.item():
        raise IndexError(f"{bad.item()} KV slot(s) out of range [0, {num_slots}): {slots.tolist()}")


@functools.cache
def kv_write_usable() -> bool:
    """Whether the KV write kernel builds here (a copy: nothing to compare)."""
    return _checked("kv_write", "KV write", "index_copy_")


def kv_write_takes(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``kv_write`` runs for these tensors (CPU fp32, layouts it reads, eager)."""
    return (
        enabled
        and _cpu_fp32(cache, k, v)
        and cache.is_contiguous()
        and slots.dtype == torch.long
        and slots.device.type == "cpu"
        and slots.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and not torch.compiler.is_compiling()
        and kv_write_usable()
    )


# ---------------------------------------------------------------------------------- SwiGLU
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, fp32 ``gate_up`` ``[rows, 2 *
    inner]`` (columns contiguous, rows any stride apart; ``swiglu_takes``): ``[rows, inner]``."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner, dtype=torch.float32)
    build("swiglu")(gate_up, out, rows, inner, gate_up.stride(0))
    return out


def eager_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's SwiGLU in aten ops, what ``swiglu`` equals."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN with NaN of the same payload, -0 apart from +0)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _swiglu_check() -> str | None:
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, 88.7, -88.7, 89.0, -104.0, 1e-30, -1e-30, 20.0, -20.0])
    specials = torch.cat([specials, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    for inner in (1536, 64, 40, 100, 31):  # whole pairs of vectors, and tails of each length
        for rows in (1, 3, 8):
            if rows * inner >= SWIGLU_MAX_ELEMENTS:
                continue
            gate_up = torch.randn(rows, 2 * inner + 3, generator=gen) * 6.0
            flat = gate_up.view(-1)
            flat[torch.randint(0, flat.numel(), (len(specials),), generator=gen)] = specials
            view = gate_up[:, : 2 * inner]  # rows 2 * inner + 3 apart, as a wider fused output's
            if not _same_bits(swiglu(view), eager_swiglu(view)):
                return f"{rows} rows of {inner} differ from aten's"
    return None


@functools.cache
def swiglu_usable() -> bool:
    """Whether the SwiGLU kernel builds here and equals ``eager_swiglu`` bit for bit."""
    return _checked("swiglu", "fused SwiGLU", "aten's silu and mul", _swiglu_check)


def swiglu_takes(gate_up: torch.Tensor) -> bool:
    """Whether ``swiglu`` runs for ``gate_up``: CPU fp32, 2-D, columns contiguous, eager, checked
    here, and fewer than ``SWIGLU_MAX_ELEMENTS`` outputs (aten's silu runs such a tensor in one
    serial loop a row at a time, the split between vector and scalar ``exp`` the kernel copies;
    a larger one is cut over the threads at places that depend on their number)."""
    return (
        enabled
        and _cpu_fp32(gate_up)
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and gate_up.shape[1] % 2 == 0
        and gate_up.shape[0] * gate_up.shape[1] // 2 < SWIGLU_MAX_ELEMENTS
        and not torch.compiler.is_compiling()
        and swiglu_usable()
    )


def describe() -> str:
    """One log line: which of the kernels run here (running their self-checks, once a process)."""
    kernels = {
        "residual add + RMSNorm": norm_width() is not None,
        "rotary embedding": rotary_usable(),
        "KV cache write": kv_write_usable(),
        "greedy argmax": argmax_usable(),
        "SwiGLU (decode rows)": swiglu_usable(),
    }
    used = [name for name, ok in kernels.items() if ok]
    left = [name for name, ok in kernels.items() if not ok]
    if not used:
        return "fused CPU kernels: none usable here; aten's ops run"
    return f"fused CPU kernels (bit for bit aten's, checked at load): {', '.join(used)}" + (
        f"; aten's ops for {', '.join(left)}" if left else ""
    )
