"""Prompt-sized linears on coded weights with Intel AMX: fp32 products from bf16 tile
multiplies, on CPUs that have AMX (Sapphire Rapids and later Xeons).

A prompt step multiplies every weight by hundreds or thousands of rows; it is bound by the
FMA units, and oneDNN runs fp32 near their peak. AMX's tile multiply (``TDPBF16PS``: a 16 x 32
by 32 x 16 bf16 product added into 16 x 16 fp32 accumulators) does 16 times the multiply-adds a
cycle of AVX-512's fp32 FMAs, but on bf16 inputs, which hold 8 of fp32's 24 significant bits.
Two facts make it exact enough to stand in for fp32 here:

* **The weights**: a coded weight (``cpu_linear.CodedPanels``) is ``d * q + m`` per group of 32
  inputs, with ``q`` an integer in 0..255, which bf16 holds exactly. So ``x . w`` over a group is
  ``d * (x . q) + m * sum(x)``, and only ``x . q`` needs the tiles.
* **The inputs**: an fp32 ``x`` is the sum of three bf16 numbers exactly (``hi``: its top 8
  significant bits, ``mid`` the next 8, ``lo`` the last 8; cut by truncation, so each rest is
  exact). Each product of a bf16 part and a code is exact in fp32, and the tiles add them in fp32.

So each group's ``x . q`` is the sum of exact products (96: 32 inputs x 3 parts) in fp32, as an
fp32 GEMM's would be, in another order; then ``d * that + m * sum(x)`` per group, added up in
fp32 (AVX-512). The result differs from the fp32 panels' in the last bits, as oneDNN's and MKL's
do from each other (the engine's greedy parity with transformers is held by its tests on this
path). Two limits of AMX: bf16 subnormals count as zero (an input part below ~1e-38 — an input
below ~1e-33 — is dropped) and fp32 results below ~1e-38 flush to zero.

The work: 3 tile multiplies where an fp32 GEMM does one, at 16 times the rate, plus per group
and 16 x 16 block a store of the accumulators and two FMAs a row (the scale and the offset). The
codes wait as bf16 tiles made once at load (``tiles``: ``[num_panels, 3, K / 32, 16, 32]``, two
bytes a weight, in the layout ``TDPBF16PS`` reads: pairs of k's side by side); the inputs are cut
into parts once per call. The threads take (row chunk, panel) pairs, so a chunk's parts stay in
L2 while the panels stream past.

Built through inductor's C++ toolchain as ``cpu_linear`` is (with the AMX target for these
functions). ``available`` says whether this CPU and kernel allow it (the CPU flags, Linux's
permission to use the tile state, the build, and a check of one product against float64);
where not, prompts keep oneDNN.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch

from workers.backends.cpu import panels as cpu_linear

logger = logging.getLogger(__name__)

TILE_ROWS = 16  # rows of a tile: input rows per block, and k pairs per group (32 k's)
BLOCK = 16  # output columns per tile: a panel of cpu_linear.PANEL is 3 of them
CHUNK_BLOCKS = 8  # 16-row blocks a work item: their input parts stay in L2 while its panel goes past

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <omp.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,fma")

constexpr int P = {panel};  // cpu_linear.PANEL: output columns a panel (the scales' layout)
constexpr int NB = P / 16;  // 16-column blocks a panel: one accumulator tile each
constexpr int G = {group};  // k's a group: one tile's depth (32 bf16)
constexpr int CB = {chunk_blocks};  // 16-row blocks a work item: their parts stay in L2

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows x 64 bytes: 0..2 a panel's accumulators (16 x 16 fp32 each); 3, 4 input
// parts (16 rows x 32 bf16), in turn; 5..7 a group's codes of each block (16 k pairs x 16 columns x 2)
static void configure() {
  alignas(64) TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
}

// x [M][K] fp32 -> parts [Mp/16][K/G][3][16][G] bf16 bits: for each block of 16 rows and group,
// three tiles, 1 KB each (hi, mid, lo: x = hi + mid + lo exactly, each cut by truncation so that
// each rest is exact); and sums [Mp][K/G], each group's inputs added in fp32, in order. Rows M..Mp-1 zero.
static void split(const float* __restrict__ x, int64_t M, int64_t Mp, int64_t K, uint16_t* __restrict__ parts,
                  float* __restrict__ sums, int64_t threads) {
  const int64_t groups = K / G;
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < Mp; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint16_t* o = parts + ((t / 16 * groups + g) * 3 * 16 + t % 16) * G;  // its hi row; mid, lo 16 rows on
      float s = 0.0f;
      for (int i = 0; i < G; i += 16) {
        const __m512 v = t < M ? _mm512_loadu_ps(x + t * K + g * G + i) : _mm512_setzero_ps();
        const __m512i hb = _mm512_and_si512(_mm512_castps_si512(v), top);
        const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(hb));  // exact: the bits below the top 8
        const __m512i mb = _mm512_and_si512(_mm512_castps_si512(r), top);
        const __m512 l = _mm512_sub_ps(r, _mm512_castsi512_ps(mb));  // exact, at most 8 significant bits
        _mm256_storeu_si256((__m256i*)(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hb, 16)));
        _mm256_storeu_si256((__m256i*)(o + 16 * G + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mb, 16)));
        _mm256_storeu_si256((__m256i*)(o + 32 * G + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(l), 16)));
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, v);
        for (int j = 0; j < 16; ++j) s += lanes[j];
      }
      sums[t * groups + g] = s;
    }
  }
}

// tiles: [num_panels][NB][K/G][16 k pairs][16 columns][2] bf16 codes (``tiles``); scales:
// cpu_linear's [num_panels][K/G][2][P] (each group's step d, then its offset m)
extern "C" void kernel(const float* x, const uint16_t* tiles, const float* scales, const float* bias, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias, int64_t threads) {
  const int64_t groups = K / G;
  const int64_t Mp = (M + 15) / 16 * 16;
  const int64_t blocks = Mp / 16;
  const int64_t chunks = (blocks + CB - 1) / CB;
  const int64_t num_panels = (N + P - 1) / P;
  // the calling thread's buffers, kept between calls (a prompt step's fresh pages cost more than the split)
  static thread_local std::vector<uint16_t> parts;
  static thread_local std::vector<float> sums;
  if ((int64_t)parts.size() < Mp * groups * 3 * G) parts.resize(Mp * groups * 3 * G);
  if ((int64_t)sums.size() < Mp * groups) sums.resize(Mp * groups);
  uint16_t* const parts_ = parts.data();  // thread_local: the OpenMP threads below use these pointers
  float* const sums_ = sums.data();
  split(x, M, Mp, K, parts_, sums_, threads);
  #pragma omp parallel num_threads(threads)
  {
    configure();
    alignas(64) float c[2][NB][16][16];  // a (group, block)'s products, stored from the tiles, two in turn
    alignas(64) float acc[CB][NB][16][16];
    // work items: (row chunk, panel); the chunk's parts stay in L2 while its panels go past
    #pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t p = 0; p < num_panels; ++p) {
        const uint16_t* tp = tiles + p * NB * groups * 512;
        const float* sp = scales + p * groups * 2 * P;
        const int64_t b0 = chunk * CB;
        const int64_t nblocks = (chunk + 1) * CB < blocks ? CB : blocks - b0;
        std::memset(acc, 0, sizeof(acc));
        // acc += d * products, for a (group, block): run one pair behind the tile multiplies, on
        // the products stored the pair before (by then those tile stores have landed)
        auto scale = [&](int64_t g, int64_t i, const float (*cc)[16][16]) {
          const float* sg = sp + g * 2 * P;
          for (int nb = 0; nb < NB; ++nb) {
            const __m512 d = _mm512_loadu_ps(sg + nb * 16);
            for (int r = 0; r < 16; ++r) {
              const __m512 v = _mm512_load_ps(acc[i][nb][r]);
              _mm512_store_ps(acc[i][nb][r], _mm512_fmadd_ps(d, _mm512_load_ps(cc[nb][r]), v));
            }
          }
        };
        int64_t pend_g = -1, pend_i = 0;
        int flip = 0;
        for (int64_t g = 0; g < groups; ++g) {
          _tile_loadd(5, tp + (0 * groups + g) * 512, 64);  // the group's codes: kept for every block
          _tile_loadd(6, tp + (1 * groups + g) * 512, 64);
          _tile_loadd(7, tp + (2 * groups + g) * 512, 64);
          for (int64_t i = 0; i < nblocks; ++i) {
            const uint16_t* a = parts_ + ((b0 + i) * groups + g) * 3 * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_loadd(3, a, 64);  // hi
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(2, 3, 7);
            _tile_loadd(4, a + 512, 64);  // mid
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(3, a + 1024, 64);  // lo
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(2, 3, 7);
            if (pend_g >= 0) scale(pend_g, pend_i, c[flip ^ 1]);
            _tile_stored(0, c[flip][0], 64);
            _tile_stored(1, c[flip][1], 64);
            _tile_stored(2, c[flip][2], 64);
            pend_g = g, pend_i = i, flip ^= 1;
          }
        }
        if (pend_g >= 0) scale(pend_g, pend_i, c[flip ^ 1]);
        // acc += m * (the group's inputs summed), over the groups: 16 rows at once, in registers
        for (int64_t i = 0; i < nblocks; ++i)
          for (int nb = 0; nb < NB; ++nb) {
            __m512 v[16];
            for (int r = 0; r < 16; ++r) v[r] = _mm512_load_ps(acc[i][nb][r]);
            const float* xs = sums_ + (b0 + i) * 16 * groups;
            for (int64_t g = 0; g < groups; ++g) {
              const __m512 m = _mm512_loadu_ps(sp + g * 2 * P + P + nb * 16);
              for (int r = 0; r < 16; ++r) v[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), v[r]);
            }
            for (int r = 0; r < 16; ++r) _mm512_store_ps(acc[i][nb][r], v[r]);
          }
        // out = acc (+ bias): the columns and rows that exist
        for (int64_t i = 0; i < nblocks; ++i)
          for (int nb = 0; nb < NB; ++nb) {
            const int64_t col0 = p * P + nb * 16;
            if (col0 >= N) break;
            const int64_t cols = N - col0 < 16 ? N - col0 : 16;
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            const __m512 bv = has_bias ? _mm512_maskz_loadu_ps(keep, bias + col0) : _mm512_setzero_ps();
            for (int r = 0; r < 16; ++r) {
              const int64_t row = (b0 + i) * 16 + r;
              if (row >= M) break;
              _mm512_mask_storeu_ps(out + row * N + col0, keep, _mm512_add_ps(_mm512_load_ps(acc[i][nb][r]), bv));
            }
          }
      }
    _tile_release();
  }
}
#pragma GCC pop_options
"""

ARGTYPES = [
    "const float*",  # x [M, K]
    "const uint16_t*",  # tiles (``tiles``)
    "const float*",  # scales (``CodedPanels.scales``)
    *cpu_linear.COMMON_ARGTYPES,
]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def build() -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = (
        _SOURCE.replace("{panel}", str(cpu_linear.PANEL))
        .replace("{group}", str(cpu_linear.GROUP))
        .replace("{chunk_blocks}", str(CHUNK_BLOCKS))
    )
    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, source)


def _self_check() -> bool:
    """One coded product against float64: the kernel runs and agrees here."""
    n, k = cpu_linear.PANEL * 2 + 5, 64
    q = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16  # every group holds 0..15
    w = q.float() * 0.0625 - 0.5  # d = 1/16, m = -1/2: on a Q4_1 grid
    coded = cpu_linear.code(w)
    if coded is None:
        return False
    x = torch.randn(TILE_ROWS * 2 + 3, k, generator=torch.Generator().manual_seed(0))
    want = (x.double() @ w.double().T).float()
    return bool(torch.allclose(linear(x, coded, tiles(coded), n), want, rtol=1e-5, atol=1e-5))


def _permit() -> bool:
    """Ask Linux for AMX's tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``):
    a process gets it only on request, and a tile instruction without it is a SIGILL."""
    import ctypes

    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 Linux
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0


@functools.cache
def available() -> bool:
    """Whether prompts on coded weights may take the AMX kernel here (asked once per process):
    x86-64 Linux with AMX's tile and bf16 units and AVX-512, Linux's permission to use the tile
    state, a build, and one product that agrees with float64. Logged when it does not."""
    if sys.platform != "linux" or not {"amx_tile", "amx_bf16", "avx512f", "avx512bw"} <= _cpu_flags():
        return False  # no AMX: nothing to say
    try:
        if not _permit():
            raise RuntimeError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        build()
        if not _self_check():
            raise RuntimeError("its product disagreed with float64")
    except Exception as exc:  # noqa: BLE001 - no compiler, an old assembler, no permission ...
        logger.warning("the AMX kernel for prompt-sized linears is off (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def tiles(coded: cpu_linear.CodedPanels) -> torch.Tensor:
    """The codes of ``coded`` as the kernel's bf16 tiles (two bytes a weight): ``[num_panels, 3,
    K / 32, 16, 32]``, for each panel's three blocks of 16 output columns and each group, a tile
    of 16 pairs of k's by the block's 16 columns, a pair's two codes side by side."""
    num_panels, k, panel = coded.codes.shape
    with torch.no_grad():
        q = coded.codes.to(torch.bfloat16)  # 0..255: exact
        q = q.view(num_panels, k // 2, 2, panel // BLOCK, BLOCK)  # [p, k pair, 2, block, column]
        q = q.permute(0, 3, 1, 4, 2)  # [p, block, k pair, column, 2]
        return q.contiguous().view(torch.int16).view(num_panels, panel // BLOCK, k // cpu_linear.GROUP, 16, 32)


def linear(
    x: torch.Tensor,
    coded: cpu_linear.CodedPanels,
    tiles_: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the weight ``coded`` holds (``tiles_``: its ``tiles``),
    ``x`` fp32 ``[..., K]`` on CPU: ``[..., out_features]``."""
    return cpu_linear.run_kernel(build(), x, (tiles_, coded.scales), out_features, bias)
